"""LoRA adapters served beside the base model (multi-LoRA, as vLLM's ``--enable-lora --lora-modules``).

Lifecycle: an engine started with ``EngineConfig.lora_modules`` (adapter name -> directory) loads every adapter
once, at start, before its model (``load_adapters``: PEFT's on-disk format, ``adapter_config.json`` and
``adapter_model.safetensors``, checked against the model's shapes before anything is kept), and attaches them
to the model's decoder layers once it is loaded (``attach``: each layer gets a ``LayerLoRA`` holding, per fused
linear, a piece per adapter and projection: A as PEFT stores it, B transposed with the adapter's scaling folded
in). A request names its adapter in
``SamplingParams.lora_name`` (None: the base model); the engine resolves it to a slot once, when the request is
added (``LoRASet.resolve``: ValueError naming ``lora_name`` for a name it does not serve), and every step the
model runner hands the model the slot of each of the step's rows (``StepLoRA``: the rows grouped by adapter;
None where every row is the base model's, so a base-only step costs nothing). Each targeted projection then adds
``scaling * (x A^T) B^T`` to the base product for the rows of each adapter in the batch (the punica/S-LoRA
idea, not merged into the weights: a step mixing adapters through one kernel call a linear, engine/csrc/lora.cpp,
otherwise torch per adapter), so one batch mixes the base model and any adapters.

A request's adapter is part of its prefix-cache identity: its blocks' chained keys start from the adapter's own
root hash (``key_root``), not the base model's, so K/V computed under one adapter is never reused under another
(engine/block_manager.py); a router computing block hashes for KV-aware routing uses the same root.

What is refused at load, by name: DoRA, bias training, ``fan_in_fan_out``, per-module rank or alpha patterns,
adapters on anything but the seven Llama projections (q, k, v, o, gate, up, down: no embedding, LM head or
``modules_to_save``), shapes that do not fit the model, ``.bin`` checkpoints (pickles; safetensors only), and, in
the engine, devices other than CPU (docs/interfaces.md, "LoRA adapters"). A tensor-parallel engine's ranks each hold
their shard of every adapter (``LoRASet.sharded``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from engine.config import ModelConfig

if TYPE_CHECKING:  # (names and config are checked where torch is not imported: a router)
    import torch
    from torch import Tensor

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (PEFT's names for a Llama-family model)."""

_MLP = ("gate_proj", "up_proj", "down_proj")
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_TENSOR_RE = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def lora_key_root(name: Optional[str], digest: bytes = b"") -> int:
    """The parent hash of the first prefix-cache block of a prompt under adapter ``name`` (None: the base model's,
    ``ROOT_HASH``): blake2b-64 of the adapter's name and ``digest``, its files' content (``LoRAAdapter.digest``).
    Every engine that loads the same files under the same name agrees, without sharing state; an adapter reloaded
    under its name with other weights starts a chain of its own, so no K/V computed under the old weights is
    reused under the new ones."""
    if name is None:
        return 0
    h = blake2b(b"pdserve-lora\0" + name.encode() + b"\0" + digest, digest_size=8)
    return int.from_bytes(h.digest(), "little") or 1


def check_lora_name(name: str, field_name: str = "lora_modules") -> str:
    """An adapter name as a user gives it: 1-128 characters of letters, digits and ``._:/-``, starting with a
    letter or digit (it is a ``model`` name on the OpenAI API)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{field_name}: adapter name must be 1-128 characters of letters, digits and '._:/-', "
                         f"starting with a letter or digit, got {name!r}")
    return name


def parse_lora_modules(value: object) -> dict[str, str]:
    """``EngineConfig.lora_modules`` in its accepted spellings: a mapping name -> directory, or vLLM's CLI form, a
    list of ``name=path`` strings (or of ``{"name": ..., "path": ...}``). Names are checked, paths are not (the
    engine loads them)."""
    if value is None:
        return {}
    out: dict[str, str] = {}
    items: list[tuple[object, object]]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for v in value:
            if isinstance(v, str) and "=" in v:
                items.append(tuple(v.split("=", 1)))  # type: ignore[arg-type]
            elif isinstance(v, Mapping) and set(v) == {"name", "path"}:
                items.append((v["name"], v["path"]))
            else:
                raise ValueError(f"lora_modules: each entry must be 'name=path' or {{'name': ..., 'path': ...}}, "
                                 f"got {v!r}")
    else:
        raise ValueError(f"lora_modules must be a mapping name -> path or a list of 'name=path', got {value!r}")
    for name, path in items:
        check_lora_name(name)  # type: ignore[arg-type]
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: adapter {name!r} needs a non-empty path, got {path!r}")
        if name in out:
            raise ValueError(f"lora_modules: adapter {name!r} is given twice")
        out[name] = path  # type: ignore[index]
    return out


@dataclass
class LoRAAdapter:
    """One adapter as loaded: per (layer, projection), A [r, in] and B [out, r] (float32), and its scaling."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)
    digest: bytes = b""
    """blake2b-128 of its two files (``adapter_config.json``, ``adapter_model.safetensors``): what it is."""

    @property
    def key_root(self) -> int:
        """Its prefix-cache chains' root (``lora_key_root``)."""
        return lora_key_root(self.name, self.digest)

    @property
    def targets(self) -> list[str]:
        """The projections it adapts (in ``PROJECTIONS`` order)."""
        have = {p for _, p in self.weights}
        return [p for p in PROJECTIONS if p in have]


def _proj_shape(mc: ModelConfig, proj: str) -> tuple[int, int]:
    """(out, in) of a projection of ``mc``."""
    H, Hkv, D, h, inter = (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.hidden_size,
                           mc.intermediate_size)
    return {"q_proj": (H * D, h), "k_proj": (Hkv * D, h), "v_proj": (Hkv * D, h), "o_proj": (h, H * D),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}[proj]


def load_adapter(name: str, path: str, mc: ModelConfig) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory and check it against ``mc``; ValueError naming the adapter and what is
    wrong (missing files, an unsupported option or target, a shape that does not fit)."""
    import torch
    from safetensors import safe_open

    where = f"lora_modules: adapter {name!r} ({path})"
    if mc.num_experts:
        raise ValueError(f"{where}: LoRA adapters on a mixture-of-experts model ({mc.architecture}) are not "
                         "supported yet")
    d = Path(path)
    cfg_path, st_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise ValueError(f"{where}: no adapter_config.json (a PEFT LoRA adapter directory is expected)")
    if not st_path.is_file():
        extra = " (adapter_model.bin is a pickle: convert it to safetensors)" if (d / "adapter_model.bin").exists() else ""
        raise ValueError(f"{where}: no adapter_model.safetensors{extra}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: adapter_config.json is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: adapter_config.json must be an object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(cfg.get(key, False)) != ok:
            raise ValueError(f"{where}: {key}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{where}: {key} (per-module rank or alpha) is not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']!r} is not supported (full copies of "
                         "modules; only LoRA projections are)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora", False) else alpha / r
    h = blake2b(digest_size=16)
    try:
        for fp in (cfg_path, st_path):
            with open(fp, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
                h.update(b"\0")
    except OSError as e:
        raise ValueError(f"{where}: cannot read its files: {e}") from None
    adapter = LoRAAdapter(name, path, r, float(scaling), digest=h.digest())
    parts: dict[tuple[int, str], dict[str, Tensor]] = {}
    try:
        with safe_open(str(st_path), framework="pt") as f:
            for key in f.keys():
                m = _TENSOR_RE.match(key)
                if m is None or m.group(3) not in PROJECTIONS:
                    raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a Llama projection "
                                     f"({', '.join(PROJECTIONS)})")
                layer = int(m.group(1))
                if layer >= mc.num_hidden_layers:
                    raise ValueError(f"{where}: tensor {key!r} names layer {layer}; the model has "
                                     f"{mc.num_hidden_layers}")
                parts.setdefault((layer, m.group(3)), {})[m.group(4)] = f.get_tensor(key)
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file: safetensors' own errors
        raise ValueError(f"{where}: adapter_model.safetensors cannot be read: {e}") from None
    if not parts:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    for (layer, proj), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {proj} has lora_{''.join(ab)} without its pair")
        out, inp = _proj_shape(mc, proj)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, inp) or tuple(b.shape) != (out, r):
            raise ValueError(f"{where}: layer {layer} {proj}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                             f"not fit r={r} and the model's {proj} ({out} x {inp}): expected ({r}, {inp}) / "
                             f"({out}, {r})")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{where}: layer {layer} {proj} holds non-finite values")
        adapter.weights[(layer, proj)] = (a.float(), b.float())
    return adapter


KERNEL_MAX_ROWS = 128
"""Rows up to which a step that mixes adapters goes through pdserve's kernel (engine/csrc/lora.cpp: one call a linear,
each adapter's weights read once); a larger one (a prefill) and a step of one adapter take torch's GEMMs per adapter.
Measured in benchmarks/lora_overhead.py (1 Dec, 2-vCPU EPYC): a `bench` decode step of 8 rows over base + 4 adapters
1.84-1.86x the base model's through torch, 1.29-1.31x through the kernel; a 512-token prefill under one adapter
1.07x through torch, 1.21-1.24x through the kernel."""


@dataclass
class _Piece:
    """One adapted projection of one adapter inside a fused linear: output columns [lo, hi) of the rows under adapter
    ``slot`` take ``(x a^T) b``."""

    slot: int
    lo: int
    hi: int
    a: Tensor  # [rank, in]: PEFT's lora_A
    b: Tensor  # [rank, hi - lo]: lora_B^T, scaling folded in


class LayerLoRA:
    """The adapters of one decoder layer: the pieces of each fused linear ('qkv_proj', 'o_proj', 'gate_up_proj',
    'down_proj'). A step that mixes adapters over at most ``KERNEL_MAX_ROWS`` rows, with pdserve's CPU kernels (float32
    on CPU): one ``lora_apply_`` call a linear adds every row's delta (engine/csrc/lora.cpp); otherwise torch, one
    shrink and expand a piece per adapter present."""

    def __init__(self, kern: object = None) -> None:
        self.kern = kern
        self.by_linear: dict[str, list[_Piece]] = {}
        self._kernel_args: dict[str, tuple[list, list, list, list]] = {}

    def add(self, linear: str, piece: _Piece) -> None:
        self.by_linear.setdefault(linear, []).append(piece)
        self._index(linear)

    def remove(self, slot: int) -> None:
        """Take adapter ``slot``'s pieces out (it was unloaded)."""
        for linear, ps in list(self.by_linear.items()):
            self.by_linear[linear] = [p for p in ps if p.slot != slot]
            if not self.by_linear[linear]:
                del self.by_linear[linear]
                self._kernel_args.pop(linear, None)
            else:
                self._index(linear)

    def _index(self, linear: str) -> None:
        ps = self.by_linear[linear]
        self._kernel_args[linear] = ([p.a for p in ps], [p.b for p in ps], [p.lo for p in ps], [p.slot for p in ps])

    def apply(self, linear: str, x: Tensor, y: Tensor, step: Optional["StepLoRA"]) -> Tensor:
        """``y`` (the base product of ``x``) plus each row's adapter's delta, in place."""
        pieces = self.by_linear.get(linear)
        if step is None or not pieces:
            return y
        x2 = x.reshape(-1, pieces[0].a.shape[1])
        y2 = y.view(-1, y.shape[-1])
        if self.kern is not None and len(step.groups) > 1 and x2.shape[0] <= KERNEL_MAX_ROWS:
            self.kern.lora_apply_(x2.contiguous(), y2, step.row_slots, *self._kernel_args[linear])
            return y
        for slot, rows in step.groups:
            xs = None
            for p in pieces:
                if p.slot != slot:
                    continue
                if xs is None:
                    xs = (x2 if rows is None else x2.index_select(0, rows)).to(p.a.dtype)
                if rows is None:
                    y2[:, p.lo:p.hi].addmm_(xs @ p.a.t(), p.b)
                else:
                    y2[:, p.lo:p.hi].index_add_(0, rows, (xs @ p.a.t()) @ p.b)
        return y


@dataclass
class StepLoRA:
    """One forward's rows by adapter: each row's slot (``row_slots``, 0: the base model) and (slot, rows) for each
    adapter present, rows None where it is every row. The model runner builds one for the step's rows
    (``AttentionMetadata.lora``) and one for the rows its last layer keeps (``keep.lora``)."""

    row_slots: Tensor
    groups: list[tuple[int, Optional[Tensor]]]

    @classmethod
    def of(cls, slots: Sequence[int], device: torch.device) -> Optional["StepLoRA"]:
        """From each row's slot (0: the base model); None where no row has an adapter."""
        import torch

        present = sorted({s for s in slots if s})
        if not present:
            return None
        slot_t = torch.tensor(list(slots), dtype=torch.long, device=device)
        if len(present) == 1 and all(s == present[0] for s in slots):
            return cls(slot_t, [(present[0], None)])
        return cls(slot_t, [(s, (slot_t == s).nonzero().squeeze(1)) for s in present])


class LoRASet:
    """The adapters an engine serves: name -> slot (1, 2, ...; 0 is the base model), each slot used once.

    Adapters given at start take slots 1..n in their order; one loaded later (``add``) the next unused slot. One
    unloaded (``retire``) stops resolving by name at once but keeps its slot and weights while requests admitted
    under it still run; the engine ``drop``s it when the last has left. ``event_ids`` (root -> slot, the KV events'
    ``lora_id``) keeps every adapter ever loaded, so the cache's blocks of an unloaded one are still reported as
    its."""

    def __init__(self, adapters: Sequence[LoRAAdapter] = ()) -> None:
        self.by_slot: dict[int, LoRAAdapter] = {}
        self.slot_of: dict[str, int] = {}
        self.event_ids: dict[int, int] = {}
        self.retired: set[int] = set()
        self._next = 1
        for ad in adapters:
            self.add(ad)

    @property
    def adapters(self) -> list[LoRAAdapter]:
        """The adapters requests may name, in slot order."""
        return [self.by_slot[s] for s in sorted(self.slot_of.values())]

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def roots(self) -> dict[str, int]:
        """Each servable adapter's prefix-cache root (``LoRAAdapter.key_root``), by name."""
        return {a.name: a.key_root for a in self.adapters}

    def add(self, adapter: LoRAAdapter, slot: Optional[int] = None) -> int:
        """Serve ``adapter`` under its name in a new slot (the next unused one, or ``slot``: a tensor-parallel
        follower takes the leader's); ValueError naming ``lora_name`` if the name is served already."""
        if adapter.name in self.slot_of:
            raise ValueError(f"lora_name: adapter {adapter.name!r} is already loaded")
        slot = self._next if slot is None else slot
        if slot in self.by_slot or slot < 1:
            raise ValueError(f"LoRA slot {slot} is taken")
        self._next = max(self._next, slot + 1)
        self.by_slot[slot] = adapter
        self.slot_of[adapter.name] = slot
        self.event_ids[adapter.key_root] = slot
        return slot

    def retire(self, name: str) -> int:
        """Stop serving ``name`` (its slot stays until ``drop``); ValueError naming ``lora_name`` if not served."""
        slot = self.resolve(name)
        if slot == 0:
            raise ValueError("lora_name: the base model is not an adapter")
        del self.slot_of[name]
        self.retired.add(slot)
        return slot

    def drop(self, slot: int) -> LoRAAdapter:
        """Forget a retired adapter's weights (no request under it is left)."""
        self.retired.discard(slot)
        return self.by_slot.pop(slot)

    def resolve(self, name: Optional[str]) -> int:
        """The slot of adapter ``name`` (None: 0, the base model); ValueError naming ``lora_name`` otherwise."""
        if name is None:
            return 0
        slot = self.slot_of.get(name)
        if slot is None:
            served = ", ".join(map(repr, self.names)) or "none"
            raise ValueError(f"lora_name: this engine serves no LoRA adapter {name!r} (adapters: {served})")
        return slot

    def attach(self, model: "torch.nn.Module", device: torch.device, dtype: torch.dtype) -> None:
        """Give each decoder layer of ``model`` (engine.model.CausalLM) its ``LayerLoRA`` holding every adapter
        here, in ``dtype`` on ``device``."""
        for slot, ad in sorted(self.by_slot.items()):
            attach_adapter(model, slot, ad, device, dtype)

    def sharded(self, layout: object) -> "LoRASet":
        """The adapters as one tensor-parallel rank holds them (``shard_adapter``), in the same slots."""
        out = LoRASet()
        for slot, ad in sorted(self.by_slot.items()):
            out.add(shard_adapter(ad, layout), slot)
        return out

    def weight_bytes(self) -> int:
        """Bytes the adapters' weights take (float32 as loaded)."""
        return sum(a.numel() * 4 + b.numel() * 4 for ad in self.by_slot.values() for a, b in ad.weights.values())


def attach_adapter(model: "torch.nn.Module", slot: int, ad: LoRAAdapter, device: torch.device,
                   dtype: torch.dtype) -> None:
    """Add adapter ``ad``'s pieces, as slot ``slot``, to each decoder layer of ``model`` (its ``LayerLoRA``, made
    on first use), in ``dtype`` on ``device``: A as PEFT stores it, B transposed with the scaling folded in."""
    import torch

    mc = model.config
    H, Hkv, D, inter = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.intermediate_size
    cols = {"q_proj": (0, H * D), "k_proj": (H * D, (H + Hkv) * D), "v_proj": ((H + Hkv) * D, (H + 2 * Hkv) * D),
            "o_proj": (0, mc.hidden_size), "gate_proj": (0, inter), "up_proj": (inter, 2 * inter),
            "down_proj": (0, mc.hidden_size)}
    kern = None
    if device.type == "cpu" and dtype == torch.float32:
        from engine.kernels import cpu_kernels

        kern = cpu_kernels()  # (None where they cannot be built, or PDSERVE_CPU_KERNELS=0: torch then)
    for i, layer in enumerate(model.layers):
        if layer.lora is None:
            layer.lora = LayerLoRA(kern)
        for proj in PROJECTIONS:
            ab = ad.weights.get((i, proj))
            if ab is not None:
                lo, hi = cols[proj]
                a, b = ab
                layer.lora.add(_FUSED[proj], _Piece(slot, lo, hi, a.to(device=device, dtype=dtype).contiguous(),
                                                    (b.t() * ad.scaling).to(device=device, dtype=dtype).contiguous()))


def detach_adapter(model: "torch.nn.Module", slot: int) -> None:
    """Take slot ``slot``'s pieces out of every decoder layer of ``model``."""
    for layer in model.layers:
        if layer.lora is not None:
            layer.lora.remove(slot)


def shard_adapter(ad: LoRAAdapter, layout: object) -> LoRAAdapter:
    """Adapter ``ad`` as one tensor-parallel rank holds it (``layout``: an engine.tensor_parallel.TPLayout): a
    column-parallel projection's (q, k, v, gate, up) B cut to this rank's output rows, a row-parallel one's (o,
    down) A to its input columns, as the base weights are; the other half whole. A row-parallel delta is then a
    partial sum, all-reduced with the base product's."""
    weights = {}
    for (i, proj), (a, b) in ad.weights.items():
        name = f"model.layers.{i}.{'mlp' if proj in _MLP else 'self_attn'}.{proj}.weight"
        if proj in ("o_proj", "down_proj"):
            a = layout.shard(name, a)  # type: ignore[attr-defined]
        else:
            b = layout.shard(name, b)  # type: ignore[attr-defined]
        weights[(i, proj)] = (a.contiguous(), b.contiguous())
    return LoRAAdapter(ad.name, ad.path, ad.rank, ad.scaling, weights, ad.digest)


def load_adapters(modules: Mapping[str, str], mc: ModelConfig) -> LoRASet:
    """Every adapter of ``modules`` (name -> directory), loaded and checked, in the given order."""
    return LoRASet([load_adapter(name, path, mc) for name, path in modules.items()])
