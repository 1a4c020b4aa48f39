"""kvtransfer package."""
