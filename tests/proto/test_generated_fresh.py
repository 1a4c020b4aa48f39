"""The committed generated protobuf code matches the .proto files."""
from proto.generate import stale_files


def test_generated_code_is_fresh() -> None:
    stale = stale_files()
    assert stale == [], f"regenerate with `python -m proto.generate`: stale {stale}"


def test_worker_services_exist() -> None:
    from proto import worker_pb2, worker_pb2_grpc

    names = set(worker_pb2.DESCRIPTOR.services_by_name)
    assert {"DecodeWorker", "PrefillWorker", "ColocatedWorker"} <= names
    assert hasattr(worker_pb2_grpc, "DecodeWorkerStub") and hasattr(worker_pb2_grpc, "PrefillWorkerStub")
