"""Small typed records the fused step takes instead of a long list of arguments.

- :class:`GateWeights`: the gate's norm weights, ``eps``, ``hc_count``, and the fp32 factors the
  kernels read (``key_query = (1 + w_key)(1 + w_query)``, ``conv_scale = 1 + w_conv``).
- :class:`ConvWeights`: the conv taps ``[C, K]``, the dilation, and the taps as fp32 ``[K, C]``.
- :class:`StepMeta`: one packed step's metadata and the state pool it reads and writes (what
  :meth:`ple.runtime.Batch.step_meta` produces).

The constructors do not check anything (the hot path builds records from tensors it already
knows); :meth:`GateWeights.build`, :meth:`ConvWeights.build` and :meth:`StepMeta.build` validate and
derive. Every twin of the gate, the conv and the fused step takes them (``ngram_gate(key, value,
hidden, gate)``, ``dilated_conv(c, conv, step, residual)``); the ``torch.ops.ple`` operators take their
tensors and numbers (:mod:`ple.ops.library` turns one into the other).
"""

from __future__ import annotations

import dataclasses

import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ConvWeights", "GateWeights", "StepMeta"]

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class GateWeights:
    """The gate's weights.

    Attributes:
        norm_key, norm_query, norm_conv: ``[C]`` grouped RMS norm weights (``C = HC*H``).
        eps: epsilon of the three norms.
        hc_count: hyper-connection streams ``HC``.
        key_query: ``[C]`` fp32 ``(1 + norm_key) * (1 + norm_query)``, contiguous.
        conv_scale: ``[C]`` fp32 ``1 + norm_conv``, contiguous.
    """

    norm_key: torch.Tensor
    norm_query: torch.Tensor
    norm_conv: torch.Tensor
    eps: float
    hc_count: int
    key_query: torch.Tensor
    conv_scale: torch.Tensor

    @classmethod
    def build(
        cls,
        norm_key: torch.Tensor,
        norm_query: torch.Tensor,
        norm_conv: torch.Tensor,
        eps: float,
        hc_count: int,
    ) -> GateWeights:
        """Validate the norm weights (one shape ``[C]``, floating, one device) and derive the fp32 factors."""
        if isinstance(hc_count, bool) or not isinstance(hc_count, int) or hc_count < 1:
            raise InvalidArgumentError(f"gate: hc_count={hc_count!r}, expected a positive int")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise InvalidArgumentError(f"gate: eps={eps!r}, expected a non-negative float")
        named = (("norm_key", norm_key), ("norm_query", norm_query), ("norm_conv", norm_conv))
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"gate: {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 1 or t.shape != norm_key.shape:
                raise InvalidArgumentError(
                    f"gate: {name}.shape={tuple(t.shape)}, expected [C] like norm_key {tuple(norm_key.shape)}"
                )
            if not t.is_floating_point():
                raise ArgumentTypeError(f"gate: {name}.dtype={t.dtype}, expected a floating dtype")
            if t.device != norm_key.device:
                raise InvalidArgumentError(f"gate: {name} is on {t.device}, norm_key on {norm_key.device}")
        if norm_key.shape[0] % hc_count:
            raise InvalidArgumentError(f"gate: C={norm_key.shape[0]} is not a multiple of hc_count={hc_count}")
        key_query, conv_scale = derive_gate_factors(norm_key, norm_query, norm_conv)
        return cls(norm_key, norm_query, norm_conv, float(eps), hc_count, key_query, conv_scale)


@dataclasses.dataclass(frozen=True)
class ConvWeights:
    """The dilated conv's weights.

    Attributes:
        weight: ``[C, K]`` taps; tap ``K-1`` multiplies the current token.
        dilation: distance in tokens between taps (``ngram_size`` in the PLE layer).
        taps: ``[K, C]`` fp32 ``weight.t()``, contiguous.
    """

    weight: torch.Tensor
    dilation: int
    taps: torch.Tensor

    @classmethod
    def build(cls, weight: torch.Tensor, dilation: int) -> ConvWeights:
        """Validate ``weight [C, K]`` and ``dilation`` and derive the fp32 ``[K, C]`` taps."""
        if not isinstance(weight, torch.Tensor):
            raise ArgumentTypeError(f"conv: weight must be a tensor, got {type(weight).__name__}")
        if weight.dim() != 2 or weight.shape[1] < 1:
            raise InvalidArgumentError(f"conv: weight.shape={tuple(weight.shape)}, expected [C, K] with K >= 1")
        if not weight.is_floating_point():
            raise ArgumentTypeError(f"conv: weight.dtype={weight.dtype}, expected a floating dtype")
        if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
            raise InvalidArgumentError(f"conv: dilation={dilation!r}, expected a positive int")
        return cls(weight, dilation, derive_conv_taps(weight))

    @property
    def window(self) -> int:
        """``W = (K-1) * dilation``: the history columns a token's taps reach back."""
        return (self.weight.shape[1] - 1) * self.dilation


@dataclasses.dataclass(frozen=True)
class StepMeta:
    """One packed step of R requests over T tokens, and the state pool it updates.

    Attributes:
        query_start_loc: ``[R+1]`` int token offsets (``0 ... T``).
        conv_state: the state pool, updated in place: ``[S, C, L]`` (the engine layout: the last
            ``L`` conv inputs of each slot's history, oldest first), or, with ``state_offsets``,
            ``[S, L, C]`` token-major where column ``j`` of slot ``s`` is row ``(state_offsets[s] + j) % L``
            (a ring: a step rewrites only its new columns; see :mod:`ple.ops.state`).
        state_indices: ``[R]`` int slot per request, ``-1`` for a row without state.
        has_initial_state: ``[R]`` bool; False starts the request fresh.
        num_rejected: ``[R]`` int rejected speculative columns at the end of the slot, or None.
        state_offsets: ``[S]`` int64 ring offsets (updated in place), or None for the engine layout.
    """

    query_start_loc: torch.Tensor
    conv_state: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    num_rejected: torch.Tensor | None = None
    state_offsets: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_start_loc: torch.Tensor,
        conv_state: torch.Tensor,
        state_indices: torch.Tensor,
        has_initial_state: torch.Tensor,
        num_rejected: torch.Tensor | None = None,
        state_offsets: torch.Tensor | None = None,
    ) -> StepMeta:
        """A record after checking the tensors' kinds (index values are checked by the ops that
        validate, e.g. :func:`ple.ops.dilated_conv` with ``validate=True``)."""
        named = [
            ("query_start_loc", query_start_loc),
            ("state_indices", state_indices),
            ("num_rejected", num_rejected),
            ("state_offsets", state_offsets),
        ]
        for name, t in named:
            if t is not None and (not isinstance(t, torch.Tensor) or t.dtype not in _INDEX_DTYPES):
                raise ArgumentTypeError(
                    f"step: {name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}"
                )
        if not isinstance(has_initial_state, torch.Tensor) or has_initial_state.dtype != torch.bool:
            raise ArgumentTypeError(
                f"step: has_initial_state must be a bool tensor, got {getattr(has_initial_state, 'dtype', None)}"
            )
        if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
            raise InvalidArgumentError(
                f"step: conv_state must be a 3-D tensor, got {getattr(conv_state, 'shape', None)}"
            )
        if state_offsets is not None and tuple(state_offsets.shape) != (conv_state.shape[0],):
            raise InvalidArgumentError(
                f"step: state_offsets.shape={tuple(state_offsets.shape)}, expected [S]=({conv_state.shape[0]},)"
            )
        return cls(query_start_loc, conv_state, state_indices, has_initial_state, num_rejected, state_offsets)

    @property
    def ring(self) -> bool:
        """Whether the pool is the token-major ring ``[S, L, C]`` (else the engine layout ``[S, C, L]``)."""
        return self.state_offsets is not None


def derive_gate_factors(
    norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``((1 + norm_key)(1 + norm_query), 1 + norm_conv)`` as contiguous fp32 ``[C]`` tensors."""
    f32 = torch.float32
    with torch.no_grad():
        key_query = ((1.0 + norm_key.detach().to(f32)) * (1.0 + norm_query.detach().to(f32))).contiguous()
        conv_scale = (1.0 + norm_conv.detach().to(f32)).contiguous()
    return key_query, conv_scale


def derive_conv_taps(weight: torch.Tensor) -> torch.Tensor:
    """``weight [C, K]`` as contiguous fp32 ``[K, C]``."""
    with torch.no_grad():
        return weight.detach().to(torch.float32).t().contiguous()
