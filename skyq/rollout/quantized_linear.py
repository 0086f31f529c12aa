"""Engine modules that hold weights exactly as they arrive on the wire and dequantize per forward.

`WireLinear` keeps a quantized linear's wire units as buffers named like the wire tensors
(`weight` e4m3 + `weight_scale_inv`; `weight` e4m3 + `weight_scale` uint8; `weight_packed` int32 +
`weight_scale` bf16 + `weight_shape`), so the model's state dict IS the wire state. Its forward asks
the strategy to dequantize (the same `deserialize` the plan and tests use) and multiplies; no
dequantized copy outlives the call. On CUDA, decode-sized inputs of an FP8 blockwise weight go to the
weight-only Triton kernel instead (`fp8_linear.fp8_weight_only_linear`): the e4m3 codes are read and
dequantized in registers, so decode never materializes a bf16 weight. FP8 recipes quantize the
input activations too, as the engine's W8A8 GEMM does; a decode step of many rows multiplies those
activation codes by the weight codes on the FP8 tensor cores (`W8A8_MIN_MEAN_ROWS`,
`fp8_linear.fp8_w8a8_linear`). `WireExperts` is the routed-experts block over per-expert linears, one module per
HF tensor (`experts.{e}.{gate,up,down}_proj`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from skyq.config.enums import Precision
from skyq.ops.grouped_mm import bf16_grouped_linear, bf16_grouped_mm_on
from skyq.ops.moe_combine import combine
from skyq.ops.moe_route import route
from skyq.ops.swiglu import is_silu, silu_mul
from skyq.quant import int4
from skyq.quant.fake_quant import Fp8ActivationQuant
from skyq.quant.kernels import dispatch
from skyq.quant.layouts import Role
from skyq.quant.strategies import QuantizationStrategy, WireSpec
from skyq.rollout.kernels import fp8_linear, int4_mxfp8_linear

TensorFn = Callable[[Tensor], Tensor]

DECODE_MAX_ROWS = 64
"""Largest row count (tokens in one forward) sent to the FP8 weight-only decode kernel in any forward
(a dense linear's limit in every forward: above it, on the H200, its dequantize + GEMM and the
kernel were both well behind bf16, the kernel ahead only at 128 rows of the larger shapes; docs/benchmarks.md, M4, "The decode kernels' tuning rules")."""

GROUPED_DECODE_MAX_MEAN_ROWS = 64
"""In a decode step (`decode_step`), the grouped FP8 weight-only kernel takes the routed experts while
they hold at most this many rows each on average (above: each stack dequantized, one grouped GEMM).
On the H200 (`benchmarks/moe_decode.py --large`; docs/benchmarks.md, M4, "The decode kernels' tuning rules") the kernel beat dequantize + grouped GEMM
at every mean up to 64 rows, and lost above it."""

W8A8_MIN_MEAN_ROWS = 8
"""In a decode step, FP8 experts averaging at least this many rows each multiply FP8 activation codes
by their FP8 weight codes on the FP8 tensor cores (`fp8_linear.fp8_grouped_w8a8_linear`), where the
recipe quantizes activations in 1 x 128 tiles; dense FP8 linears do above `DECODE_MAX_ROWS` rows. On
the H200 (`benchmarks/moe_decode.py --large --w8a8-configs`, Qwen3-30B-A3B's experts; docs/benchmarks.md, M4, "The decode kernels' tuning rules") the
FP8 x FP8 kernel beat the grouped weight-only kernel from 8 rows an expert on, its activations'
quantization included, and the weight-only kernel fell behind bf16's grouped GEMM as rows grew."""

_DECODE_STEP: ContextVar[bool] = ContextVar("skyq_decode_step", default=False)


@contextlib.contextmanager
def decode_step() -> Iterator[None]:
    """Mark the forwards inside as the engine's one-token decode steps (each row one new token; the
    decoders wrap every such step, its graph capture included). Their outputs need not carry the
    trainer's bits (the engine's scoring and prefill do), so the experts and the shared q/k/v
    projections compute from their stacks at any batch: no copy of a gate+up stack's halves, FP8
    experts through the grouped weight-only kernel (`GROUPED_DECODE_MAX_MEAN_ROWS`) instead of
    dequantizing every expert each step. Without it, a batch above `DECODE_MAX_ROWS` rows took the
    prefill path every step, copying bf16 stacks and dequantizing FP8 ones each step (docs/benchmarks.md, M4, "The decode kernels' tuning rules")."""
    token = _DECODE_STEP.set(True)
    try:
        yield
    finally:
        _DECODE_STEP.reset(token)


def in_decode_step() -> bool:
    """Whether the current forward is inside `decode_step`."""
    return _DECODE_STEP.get()


def _rows(x: Tensor) -> int:
    """x's rows: the product of all but its last dim."""
    return x.numel() // max(x.shape[-1], 1)


def _decode_sized(x: Tensor) -> bool:
    """x's rows take the decode paths: at most `DECODE_MAX_ROWS`, or a decode step's."""
    return _rows(x) <= DECODE_MAX_ROWS or in_decode_step()


def w8a8_quantizer(linear: nn.Module, device: torch.device) -> Fp8ActivationQuant | None:
    """The activation quantizer whose codes a decode step may multiply by this linear's FP8 weight
    codes on `device` (`fp8_linear.fp8_w8a8_linear`): an FP8 blockwise `WireLinear` of 128 x 128 weight
    blocks whose recipe quantizes its input in 1 x 128 tiles, on a GPU with e4m3 tensor cores, unless
    its `codes_decode` is off."""
    act = getattr(linear, "activation", None)
    return (
        act
        if _is_fp8(linear)
        and linear.codes_decode
        and isinstance(act, Fp8ActivationQuant)
        and act.tile == fp8_linear.W8A8_BLOCK[1]
        and tuple(linear.strategy.block()) == fp8_linear.W8A8_BLOCK
        and fp8_linear.w8a8_kernel_available(device)
        else None
    )


def _w8a8_linear(quantizer: Fp8ActivationQuant, x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """x [..., K] by an FP8 weight through its activation codes (`fp8_linear.fp8_w8a8_linear`)."""
    xq, xs = quantizer.codes(x.reshape(-1, x.shape[-1]))
    return fp8_linear.fp8_w8a8_linear(xq, xs, q, s, out_dtype=x.dtype).reshape(*x.shape[:-1], q.shape[0])


def _large_decode_step(x: Tensor) -> bool:
    """x is a decode step's bf16 CUDA input of more than `DECODE_MAX_ROWS` rows (the weight-only
    kernel's limit for a dense linear)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and in_decode_step() and _rows(x) > DECODE_MAX_ROWS


def int4_decodes(linear: nn.Module, x: Tensor) -> bool:
    """A decode step's input x to this linear takes the INT4 weight-only kernel
    (`int4_mxfp8_linear.int4_weight_only_linear`): a symmetric INT4 `WireLinear` (its words and group scales)
    that the kernel takes on x's device. Prefill and scoring keep the dequantized weight and the
    regular GEMM (the trainer's bits)."""
    return (
        isinstance(linear, WireLinear)
        and linear.strategy.precision is Precision.int4_qat
        and tuple(linear._buffers) == INT4_LEAVES
        and int4_mxfp8_linear.int4_kernel_takes(
            x, linear._buffers["weight_packed"], linear._buffers["weight_scale"], linear.strategy.group_size
        )
    )


def mxfp8_decodes(linear: nn.Module, x: Tensor) -> bool:
    """A decode step's (activation-quantized) input x to this linear takes the MXFP8 weight-only
    kernel (`int4_mxfp8_linear.mxfp8_weight_only_linear`): an MXFP8 `WireLinear` (codes and E8M0 scales) the
    kernel takes on x's device. Prefill and scoring keep the dequantized weight (the trainer's bits)."""
    return (
        isinstance(linear, WireLinear)
        and linear.strategy.precision is Precision.mxfp8
        and tuple(linear._buffers) == MXFP8_LEAVES
        and int4_mxfp8_linear.mxfp8_kernel_takes(
            x, linear._buffers["weight"], linear._buffers["weight_scale"]
        )
    )


def decodes_in_kernel(linear: nn.Module, x: Tensor) -> bool:
    """An INT4 or MXFP8 `WireLinear` takes its weight-only decode kernel for x (`int4_decodes`,
    `mxfp8_decodes`)."""
    return int4_decodes(linear, x) or mxfp8_decodes(linear, x)


class WireLinear(nn.Module):
    """A bias-free linear whose weight lives as wire tensors; dequantized inside `forward`."""

    def __init__(
        self,
        hf_name: str,
        role: Role,
        specs: list[WireSpec],
        strategy: QuantizationStrategy,
        activation: TensorFn | None,
    ) -> None:
        super().__init__()
        self.hf_name = hf_name
        self.role = role
        self.stem = hf_name.removesuffix("weight")
        self.strategy = strategy
        self.activation = activation
        for spec in specs:
            if not spec.name.startswith(self.stem):
                raise ValueError(f"{spec.name}: wire tensor of {hf_name} outside its module")
            self.register_buffer(spec.name[len(self.stem) :], torch.zeros(spec.shape, dtype=spec.dtype))

    def wire(self) -> dict[str, Tensor]:
        return {self.stem + leaf: buffer for leaf, buffer in self._buffers.items()}

    shared: SharedInput | None = None
    """The group of linears reading one input that this one belongs to (`SharedInput`), if any."""
    slot = 0
    codes_decode = True
    """Large decode steps may multiply this linear's activation codes by its weight codes
    (`w8a8_quantizer`; the engine sets it from `rollout.fp8_codes_decode`)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.shared is not None and (y := self.shared.output(self.slot, x)) is not None:
            return y
        if _large_decode_step(x) and (quantizer := w8a8_quantizer(self, x.device)) is not None:
            return _w8a8_linear(quantizer, x, self._buffers["weight"], self._buffers["weight_scale_inv"])
        if self.activation is not None:
            x = self.activation(x)
        if self._decodes_from_fp8(x):
            # e4m3 codes and block scales read and dequantized in registers: no dequantized weight
            return fp8_linear.fp8_weight_only_linear(
                x, self._buffers["weight"], self._buffers["weight_scale_inv"], self.strategy.block()
            )
        if in_decode_step() and int4_decodes(self, x):
            # INT4 words and group scales read and dequantized in registers
            packed, scale = self._buffers["weight_packed"], self._buffers["weight_scale"]
            return int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, self.strategy.group_size)
        if in_decode_step() and mxfp8_decodes(self, x):  # e4m3 codes and E8M0 scales, in registers
            return int4_mxfp8_linear.mxfp8_weight_only_linear(
                x, self._buffers["weight"], self._buffers["weight_scale"]
            )
        weight = self.strategy.deserialize(self.hf_name, self.wire(), role=self.role, dtype=x.dtype)
        return F.linear(x, weight)

    def _decodes_from_fp8(self, x: Tensor) -> bool:
        """Decode-sized bf16 inputs of an FP8 blockwise weight on CUDA take the weight-only kernel;
        prefill (more than DECODE_MAX_ROWS rows) and CPU dequantize and use the regular GEMM."""
        return (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and self.strategy.precision is Precision.fp8_blockwise
            and _rows(x) <= DECODE_MAX_ROWS
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{leaf}={tuple(b.shape)}:{b.dtype}" for leaf, b in self._buffers.items())


class ExpertMLP(nn.Module):
    """One routed expert: down(act(gate(x)) * up(x))."""

    def __init__(
        self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn: TensorFn
    ) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class WireExperts(nn.ModuleList):
    """Routed experts as a list of `ExpertMLP` (names `<layer>.mlp.experts.{e}.<proj>`), called like
    transformers' fused experts module: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]).

    After `stack()`, each projection's weights of all experts are one [E, ...] tensor whose slices
    ARE the experts' tensors, and a call on CUDA runs three grouped launches (no host sync, an
    expert without tokens reads nothing) instead of a Python loop over the routed experts with a
    host sync: FP8 blockwise experts at decode sizes through `fp8_linear.fp8_grouped_weight_only_linear`
    (codes and scales stacked), bf16 experts and FP8 prefill (each stack dequantized in one launch)
    through `torch._grouped_mm` (compute capability >= 9); in a decode step of at least
    `W8A8_MIN_MEAN_ROWS` rows an expert, FP8 experts multiply their inputs' FP8 codes by the weight
    codes (`fp8_linear.fp8_grouped_w8a8_linear`). INT4 and MXFP8 experts (codes and scales
    stacked) take the grouped path outside decode steps, each stack dequantized as the loop's
    experts dequantize theirs (MXFP8: the rows' activation quantization first, per row as theirs):
    prefill and scoring then compute as the trainer's grouped experts do, so their scores carry the
    trainer's bits on a GPU too. In a decode step INT4 experts run the grouped INT4 weight-only
    kernel (`int4_mxfp8_linear.int4_grouped_weight_only_linear`) and MXFP8 experts, after their rows'
    activation quantization, the grouped MXFP8 one (`int4_mxfp8_linear.mxfp8_grouped_weight_only_linear`):
    codes and scales dequantized in registers, no host sync."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, modules=None) -> None:
        super().__init__(modules)
        self.stacked: dict[str, tuple[Tensor, Tensor | None]] = {}
        self.kind: str | None = None
        """What `stack` stacked (`_kind`): "fp8", "int4", "mxfp8" (codes and scales) or "bf16"."""

    def stack(self) -> bool:
        """Put each projection's weight of all experts into one tensor (FP8: `weight` and
        `weight_scale_inv`; INT4: `weight_packed` and `weight_scale`; MXFP8: `weight` and
        `weight_scale`) and make the experts' tensors views of it (values kept; in-place weight loads
        land in the stack). gate and up share one [E, 2I, K] stack where their rows allow it (FP8: I
        a whole number of scale blocks; INT4 and MXFP8: one input width and (INT4) group size), so
        one launch computes both (INT4 and MXFP8: in decode steps; elsewhere each half is its own
        GEMM). For FP8 blockwise, symmetric INT4 or MXFP8 `WireLinear` experts or bias-free bf16
        `nn.Linear` ones, of equal shapes; returns whether it stacked. Call it once the module is on
        its device (a later move stacks again, see `_apply`)."""
        projs = [[getattr(expert, p) for expert in self] for p in self.PROJECTIONS]
        linears = [lin for ps in projs for lin in ps]
        kind = _kind(linears[0]) if linears else None
        if kind is None or any(_kind(lin) != kind for lin in linears):
            return False
        gate, up, down = projs
        fused = [[g, u] for g, u in zip(gate, up, strict=True)]
        grids = {"down_proj": [[lin] for lin in down]}
        if (rows_stackable(fused[0]) or _row_scaled_stackable(fused[0])) and _grid_uniform(fused):
            grids["gate_up_proj"] = fused
        else:
            grids.update(gate_proj=[[lin] for lin in gate], up_proj=[[lin] for lin in up])
        if not all(_grid_uniform(grid) for grid in grids.values()):
            return False  # checked before any tensor moves: nothing changed
        stacked = {name: stack_rows(grid) for name, grid in grids.items()}
        if "gate_up_proj" in stacked:
            leaves, store = _stacked_leaves(kind)
            width = getattr(gate[0], store)[leaves[0]].shape[0]
            stacked["gate_proj"] = _row_slice(stacked["gate_up_proj"], 0, width, gate[0])
            stacked["up_proj"] = _row_slice(stacked["gate_up_proj"], width, 2 * width, gate[0])
        self.stacked, self.kind = stacked, kind
        return True

    def _apply(self, fn, recurse=True):
        """`.to()` / `.cuda()` / ... give every buffer a new tensor: stack them again (the old stack
        would hold stale values)."""
        out = super()._apply(fn, recurse)
        if self.stacked:
            self.stacked, self.kind = {}, None
            self.stack()
        return out

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self._grouped_applies(hidden_states, top_k_index.shape[-1]):
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            token_idx, k_pos = torch.where(top_k_index == expert)
            expert_out = self[expert](hidden_states[token_idx]) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))
        return out

    def _fp8_path(self, x: Tensor, top_k: int) -> str | None:
        """How FP8 stacks compute x's tokens' routed rows (None for other kinds): "w8a8" in a decode
        step whose experts average at least `W8A8_MIN_MEAN_ROWS` rows each, where `w8a8_quantizer`
        allows (activation codes by weight codes on the FP8 tensor cores); "kernel", the grouped
        weight-only kernel, up to `DECODE_MAX_ROWS` tokens in any forward and in a decode step while
        the experts average at most `GROUPED_DECODE_MAX_MEAN_ROWS` rows; else "dequantized" (each
        stack dequantized once, one grouped GEMM)."""
        if self.kind != "fp8":
            return None
        rows, step = x.shape[0] * top_k, in_decode_step()
        if (
            step
            and rows >= W8A8_MIN_MEAN_ROWS * len(self)
            and all(w8a8_quantizer(getattr(self[0], p), x.device) for p in self.PROJECTIONS)
        ):
            return "w8a8"
        if x.shape[0] <= DECODE_MAX_ROWS or (step and rows <= GROUPED_DECODE_MAX_MEAN_ROWS * len(self)):
            return "kernel"
        return "dequantized"

    def _grouped_applies(self, x: Tensor, top_k: int) -> bool:
        """Stacked experts on CUDA, bf16 tokens: FP8 decode sizes take the grouped weight-only
        kernel or, in large decode steps, the grouped FP8 x FP8 one; INT4 decode steps the grouped
        INT4 kernel; everything else (bf16 experts, FP8 prefill, INT4 / MXFP8 outside decode steps)
        `torch._grouped_mm`, which needs sm_90+."""
        if not (self.stacked and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] > 0):
            return False
        if self.kind in DEQUANTIZED_KINDS and in_decode_step():
            return self._kernel_decodes(x) and all(self._stack_is_live(p) for p in self.PROJECTIONS)
        if self._fp8_path(x, top_k) not in ("kernel", "w8a8") and not bf16_grouped_mm_on(x.device):
            return False
        return all(self._stack_is_live(p) for p in self.PROJECTIONS)

    def _kernel_decodes(self, x: Tensor) -> bool:
        """INT4 / MXFP8 stacks in a decode step: the grouped INT4 / MXFP8 kernel takes every
        projection's stack (`int4_mxfp8_linear.int4_kernel_takes`, `int4_mxfp8_linear.mxfp8_kernel_takes`)."""
        if self.kind == "int4":
            group = self[0].gate_proj.strategy.group_size
            return all(int4_mxfp8_linear.int4_kernel_takes(x, q, s, group) for q, s in self.stacked.values())
        if self.kind == "mxfp8":
            return all(int4_mxfp8_linear.mxfp8_kernel_takes(x, q, s) for q, s in self.stacked.values())
        return False

    def capturable(self, x: Tensor, top_k: int) -> bool:
        """A forward of x's shape, `top_k` experts a token, launches without a host sync (so a CUDA
        graph can capture it): the grouped path applies and, where the FP8 grouped kernel is meant
        to, it takes every projection (elsewhere the per-expert form reads the offsets on the host)."""
        if not self._grouped_applies(x, top_k):
            return False
        path = self._fp8_path(x, top_k)
        if path != "kernel":  # the FP8 x FP8 kernel (`w8a8_quantizer` checked its device) or torch's
            return True
        from skyq.rollout.kernels import triton_fp8_gemv

        block = self[0].gate_proj.strategy.block()
        return dispatch.uses_kernel(x) and all(
            triton_fp8_gemv.grouped_applies(x, q, block) for q, _ in self.stacked.values()
        )

    def _stack_is_live(self, proj: str) -> bool:
        """The first and last experts' tensors are still views of the stack (a move restacks, see
        `_apply`; anything else that replaced them since `stack` turns the grouped path off)."""
        q, s = self.stacked[proj]
        leaves, store = _stacked_leaves(self.kind)
        return all(
            getattr(getattr(self[e], proj), store)[leaf].data_ptr() == stack[e].data_ptr()
            for e in (0, len(self) - 1)
            for leaf, stack in zip(leaves, (q, s), strict=False)
        )

    def _grouped_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The loop's result from rows sorted by expert: each projection one grouped launch, then each
        token's expert outputs added in ascending expert order in the output dtype, as the loop's
        `index_add_` calls do (`moe_combine.combine`: one launch on CUDA)."""
        t, k = top_k_index.shape
        # rows by expert, then token (the loop's row order); expert e's rows: no host sync
        order, position, offsets, token = route(top_k_index, len(self))
        first = self[0]
        path = self._fp8_path(hidden_states, k)
        if path == "w8a8":
            down = self._w8a8_experts(hidden_states, offsets, token)
            return combine(down, order, top_k_index, top_k_weights, hidden_states.dtype, position=position)
        xs = hidden_states[token]
        decode = _decode_sized(hidden_states)
        kernel = path == "kernel"
        if (
            decode
            and "gate_up_proj" in self.stacked
            and (self.kind not in DEQUANTIZED_KINDS or in_decode_step())
        ):  # one launch (and one activation quantization)
            gate, up = self._grouped(first.gate_proj, "gate_up_proj", xs, offsets, decode, kernel).chunk(
                2, dim=-1
            )
        else:
            gate = self._grouped(first.gate_proj, "gate_proj", xs, offsets, decode, kernel)
            up = self._grouped(first.up_proj, "up_proj", xs, offsets, decode, kernel)
        if decode and is_silu(first.act_fn):  # one launch (prefill keeps the trainer's torch ops)
            act = silu_mul(gate, up)
        else:
            act = first.act_fn(gate) * up
        down = self._grouped(first.down_proj, "down_proj", act, offsets, decode, kernel)
        return combine(down, order, top_k_index, top_k_weights, hidden_states.dtype, position=position)

    def _w8a8_experts(self, hidden_states: Tensor, offsets: Tensor, token: Tensor) -> Tensor:
        """The routed rows' down projections [T * k, H] in a large decode step, on FP8 codes both
        sides (`fp8_linear.fp8_grouped_w8a8_linear`): each token's input quantized once (1 x 128
        tiles; the routed rows read their token's codes through `token`), gate and up one launch
        from their stack, `silu * up` one launch, its codes, down one launch."""
        first = self[0]

        def grouped(proj: str, xq: Tensor, xs: Tensor, index: Tensor | None = None) -> Tensor:
            q, s = self.stacked[proj]
            return fp8_linear.fp8_grouped_w8a8_linear(
                xq, xs, q, s, offsets, index=index, out_dtype=hidden_states.dtype
            )

        xq, xs = first.gate_proj.activation.codes(hidden_states)
        if "gate_up_proj" in self.stacked:
            gate, up = grouped("gate_up_proj", xq, xs, token).chunk(2, dim=-1)
        else:
            gate, up = grouped("gate_proj", xq, xs, token), grouped("up_proj", xq, xs, token)
        act = silu_mul(gate, up) if is_silu(first.act_fn) else first.act_fn(gate) * up
        return grouped("down_proj", *first.down_proj.activation.codes(act))

    def _grouped(
        self, linear: nn.Module, proj: str, x: Tensor, offsets: Tensor, decode: bool, kernel: bool
    ) -> Tensor:
        q, s = self.stacked[proj]
        if not decode:
            # prefill / scoring: each projection's own GEMM, as the trainer's experts compute it (a
            # gate+up stack's halves copied out contiguous), so the scores keep the trainer's bits
            q, s = q.contiguous(), (s.contiguous() if s is not None else None)
        if s is None:
            return bf16_grouped_linear(x, q, offsets)
        if self.kind == "int4" and in_decode_step():  # words and scales dequantized in registers
            return int4_mxfp8_linear.int4_grouped_weight_only_linear(
                x, q, s, offsets, linear.strategy.group_size
            )
        if self.kind == "mxfp8" and in_decode_step():  # the rows' activation quantization, then the codes
            x = linear.activation(x) if linear.activation is not None else x
            return int4_mxfp8_linear.mxfp8_grouped_weight_only_linear(x, q, s, offsets)
        if self.kind in DEQUANTIZED_KINDS:  # the stack dequantized as each expert's forward does its own
            if linear.activation is not None:
                x = linear.activation(x)
            return bf16_grouped_linear(x, _dequantized_stack(self.kind, linear, q, s, x.dtype), offsets)
        if linear.activation is not None:
            x = linear.activation(x)
        # prefill, or a decode step above the kernel's rows: the stack dequantized once, one grouped GEMM
        if not kernel:
            name = linear.hf_name.replace(".experts.0.", ".experts.*.")
            w = dispatch.dequantize_fp8_blockwise(
                q, s, block_size=linear.strategy.block(), dtype=x.dtype, name=name
            )
            return bf16_grouped_linear(x, w, offsets)
        return fp8_linear.fp8_grouped_weight_only_linear(x, q, s, offsets, linear.strategy.block())


def _is_fp8(lin: nn.Module) -> bool:
    return isinstance(lin, WireLinear) and lin.strategy.precision is Precision.fp8_blockwise


INT4_LEAVES = ("weight_packed", "weight_scale", "weight_shape")
"""A symmetric INT4 `WireLinear`'s wire buffers (an asymmetric one has `weight_zero_point` too)."""

MXFP8_LEAVES = ("weight", "weight_scale")
"""An MXFP8 `WireLinear`'s wire buffers: e4m3 codes and ue8m0 scales, one per 32 columns."""

_DEQUANTIZED_WIRE = {Precision.int4_qat: ("int4", INT4_LEAVES), Precision.mxfp8: ("mxfp8", MXFP8_LEAVES)}
"""Per precision: the kind of stack `WireExperts` dequantizes whole, and the wire buffers it takes."""

DEQUANTIZED_KINDS = tuple(kind for kind, _ in _DEQUANTIZED_WIRE.values())
"""Stacks `WireExperts` dequantizes whole for a grouped GEMM, outside decode steps only (in decode
steps they go to the grouped INT4 / MXFP8 weight-only kernels)."""


def _kind(lin: nn.Module) -> str | None:
    """How `WireExperts.stack` stacks this linear's weight: "fp8", "int4", "mxfp8", "bf16", or None
    (it cannot)."""
    if _is_fp8(lin):
        return "fp8"
    if isinstance(lin, WireLinear) and lin.strategy.precision in _DEQUANTIZED_WIRE:
        kind, leaves = _DEQUANTIZED_WIRE[lin.strategy.precision]
        return kind if tuple(lin._buffers) == leaves else None
    return "bf16" if _is_bf16_linear(lin) else None


def _dequantized_stack(kind: str, linear: WireLinear, q: Tensor, s: Tensor, dtype: torch.dtype) -> Tensor:
    """An INT4 / MXFP8 stack [E, N, ...] dequantized to [E, N, K] by the function its experts'
    own forwards dequantize with (`strategy.deserialize`), so each expert's slice is bit for bit
    the weight its loop would multiply by; errors name the projection of every expert."""
    name = linear.hf_name.replace(".experts.0.", ".experts.*.")
    if kind == "int4":
        n, k = q.shape[-2], q.shape[-1] * int4.CODES_PER_WORD
        return dispatch.dequantize_int4_packed(
            q, s, (n, k), group_size=linear.strategy.group_size, dtype=dtype, name=name
        )
    return dispatch.dequantize_mxfp8(q, s, dtype=dtype, name=name)


def _is_bf16_linear(lin: nn.Module) -> bool:
    return isinstance(lin, nn.Linear) and lin.bias is None and lin.weight.dtype == torch.bfloat16


def rows_stackable(members: list[nn.Module]) -> bool:
    """Whether these linears' weights can be one weight, their rows one after another: all FP8
    blockwise `WireLinear`s or all bias-free bf16 `nn.Linear`s of one input width and device; FP8 also
    every member but the last a whole number of scale-block rows (else the scale rows would not
    line up with the weight rows)."""
    kinds = {_kind(m) for m in members}
    if kinds not in ({"fp8"}, {"bf16"}):
        return False
    first = members[0].weight
    if any(m.weight.shape[1:] != first.shape[1:] or m.weight.device != first.device for m in members):
        return False
    if kinds == {"fp8"}:
        bn = members[0].strategy.block()[0]
        return all(m.strategy.block() == members[0].strategy.block() for m in members) and all(
            m.weight.shape[0] % bn == 0 for m in members[:-1]
        )
    return True


def _row_scaled_stackable(members: list[nn.Module]) -> bool:
    """Symmetric INT4 or MXFP8 `WireLinear`s (all one kind) whose codes and scales can be one stack,
    rows one after another: one input width, dtype and device, and (INT4) group size; each row has
    its own scales."""
    kind = _kind(members[0])
    if kind not in ("int4", "mxfp8") or any(_kind(m) != kind for m in members):
        return False
    first = members[0]
    leaves, _ = _stacked_leaves(kind)
    return all(
        (kind != "int4" or m.strategy.group_size == first.strategy.group_size)
        and all(
            m._buffers[leaf].shape[1:] == first._buffers[leaf].shape[1:]
            and m._buffers[leaf].dtype == first._buffers[leaf].dtype
            and m._buffers[leaf].device == first._buffers[leaf].device
            for leaf in leaves
        )
        for m in members
    )


def _grid_uniform(grid: list[list[nn.Module]]) -> bool:
    """Every unit's members have the first unit's stored shapes, dtypes and devices."""
    leaves, store = _stacked_leaves(_kind(grid[0][0]))
    return all(
        len({tuple((tuple(t.shape), t.dtype, t.device) for t in unit) for unit in tensors}) == 1
        for tensors in ([[getattr(lin, store)[leaf] for lin in unit] for unit in grid] for leaf in leaves)
    )


def stack_rows(grid: list[list[nn.Module]]) -> tuple[Tensor, Tensor | None]:
    """One tensor per stored leaf for `grid[e]` (units, e.g. experts) of row-stacked members (e.g.
    gate then up): [E, sum of the members' rows, ...] (FP8 codes and their scale rows; bf16 weights),
    values kept, every member's tensor made a view of it (so in-place weight loads land in it).
    Returns (weight stack, scale stack or None for bf16). The grid must pass `_grid_uniform` (and,
    for more than one member, `rows_stackable`)."""
    leaves, store = _stacked_leaves(_kind(grid[0][0]))
    buffers = store == "_buffers"
    stacks = [
        torch.stack([torch.cat([getattr(lin, store)[leaf].detach() for lin in unit]) for unit in grid])
        for leaf in leaves
    ]
    for leaf, stack in zip(leaves, stacks, strict=True):
        for e, unit in enumerate(grid):
            row = 0
            for lin in unit:
                t = getattr(lin, store)[leaf]
                view = stack[e, row : row + t.shape[0]]
                row += t.shape[0]
                getattr(lin, store)[leaf] = (
                    view if buffers else nn.Parameter(view, requires_grad=t.requires_grad)
                )
    return stacks[0], (stacks[1] if buffers else None)


def _row_slice(
    stacked: tuple[Tensor, Tensor | None], lo: int, hi: int, member: nn.Module
) -> tuple[Tensor, Tensor | None]:
    """Rows lo:hi of a row stack (FP8: their scale rows too, lo a multiple of the block rows;
    INT4, MXFP8: their scales' rows)."""
    q, s = stacked
    if s is None:
        return q[:, lo:hi], None
    if _kind(member) in ("int4", "mxfp8"):
        return q[:, lo:hi], s[:, lo:hi]
    bn = member.strategy.block()[0]
    return q[:, lo:hi], s[:, lo // bn : -(-hi // bn)]


def _stacked_leaves(kind: str | None) -> tuple[tuple[str, ...], str]:
    """What `WireExperts.stack` stacks of each expert linear of this `_kind`, and where the module
    keeps it: FP8, INT4 or MXFP8 wire buffers (codes and scales; INT4's `weight_shape` stays each
    expert's), or a bf16 `nn.Linear`'s weight parameter."""
    if kind == "fp8":
        return ("weight", "weight_scale_inv"), "_buffers"
    if kind == "int4":
        return INT4_LEAVES[:2], "_buffers"  # not weight_shape
    if kind == "mxfp8":
        return MXFP8_LEAVES, "_buffers"
    return ("weight",), "_parameters"


class PlainLinear(nn.Linear):
    """An unquantized linear that may belong to a `SharedInput` group (see `WireLinear.shared`)."""

    shared: SharedInput | None = None
    slot = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.shared is not None and (y := self.shared.output(self.slot, x)) is not None:
            return y
        return super().forward(x)


def plain_linear(shape: tuple[int, ...], dtype: torch.dtype) -> PlainLinear:
    """An unquantized bias-free linear of weight shape (out, in), zero-filled until weights load."""
    linear = PlainLinear(shape[1], shape[0], bias=False, dtype=dtype)
    nn.init.zeros_(linear.weight)
    return linear.requires_grad_(False)


class SharedInput:
    """Linears called one after another on one input (an attention block's q, k and v projections):
    their weights one row-stacked tensor (`stack_rows`; the members' tensors views of it, so weight
    loads land in it), and at decode sizes on CUDA the first member's call computes every member's
    output in one launch, with one activation quantization; each later member called with that same
    input tensor gets its slice. Any other call pattern (another input, another order, prefill
    sizes, CPU, a member whose weight was replaced) computes each member on its own, as before."""

    def __init__(self, members: list[nn.Module]) -> None:
        if not rows_stackable(members):
            raise ValueError("SharedInput: these linears cannot share one weight (see rows_stackable)")
        self.members = members
        q, s = stack_rows([members])
        self.weight, self.scale = q[0], (s[0] if s is not None else None)
        rows = [m.weight.shape[0] for m in members]
        self.bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]
        self._x: Tensor | None = None
        self._y: Tensor | None = None
        for slot, member in enumerate(members):
            member.shared, member.slot = self, slot

    def applies(self, x: Tensor) -> bool:
        """Decode-sized bf16 input on CUDA (`_decode_sized`), every member still a view of the stack."""
        return (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and _decode_sized(x)
            and all(
                m.weight.data_ptr() == self.weight[a].data_ptr()
                for m, a in zip(self.members, self.bounds, strict=False)
            )
        )

    def output(self, slot: int, x: Tensor) -> Tensor | None:
        """Member `slot`'s output for x from the shared launch, or None: the member computes it."""
        if slot == 0:
            self._x = self._y = None
            if not self.applies(x):
                return None
            self._x, self._y = x, self._all(x)
        elif self._x is not x or self._y is None:
            return None
        y = self._y[..., self.bounds[slot] : self.bounds[slot + 1]]
        if slot == len(self.members) - 1:
            self._x = self._y = None
        return y

    def _all(self, x: Tensor) -> Tensor:
        lead = self.members[0]
        if self.scale is None:
            return F.linear(x, self.weight)
        if _large_decode_step(x) and (quantizer := w8a8_quantizer(lead, x.device)) is not None:
            return _w8a8_linear(quantizer, x, self.weight, self.scale)  # on codes both sides
        if lead.activation is not None:
            x = lead.activation(x)
        if _rows(x) > DECODE_MAX_ROWS:  # a large decode step: one dequantized stack
            w = dispatch.dequantize_fp8_blockwise(
                self.weight, self.scale, block_size=lead.strategy.block(), dtype=x.dtype, name=lead.hf_name
            )
            return F.linear(x, w)
        return fp8_linear.fp8_weight_only_linear(x, self.weight, self.scale, lead.strategy.block())
