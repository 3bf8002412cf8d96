"""The gate and conv of a training step (fp32) with a backward written out: fewer, larger operations.

:meth:`ple.PLELayer.forward_padded` runs the literal reference ops (:mod:`ple.ops.gate.reference`,
the grouped RMS norms, ``F.conv1d``); recorded by autograd they make about a hundred small
operations per step, each a pass over ``[T, HC*H]`` and, with several threads, a synchronization of
them. :func:`gate_conv_padded` computes the same function in fp32 as one autograd node whose
backward is derived by hand:

- forward: the reference's operations, in its order: the same bits as without gradients;
- backward: ``silu``'s derivative in one operation, the conv's input and weight gradients from
  shifted slices in the ``[B, S, C]`` layout (four multiply-adds each, no transposes), each grouped RMS norm's backward as ``r * (dy*w - y * mean(dy*w*y))`` with its weight's
  gradient, the gate's sigmoid and signed square root in closed form; gradients are computed only for
  the inputs that require them (a frozen model's weights get none).

On the CPU the backward runs as one C kernel (``ple_gate_conv_backward``, ``ple_train.c``: two passes
over the rows, sums over rows in fixed row ranges, so the same bits for any thread count and instruction
set); elsewhere, or with :data:`NATIVE_BACKWARD` off, as the PyTorch operations below.

Every gradient equals autograd's through the reference within fp32 rounding (``tests/test_layer.py``
compares both with transformers'). Only fp32 takes this path; bf16/fp16 keep autograd through the
reference, which rounds each intermediate to the activation dtype exactly as transformers does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ple.ops.records import GateWeights

__all__ = ["gate_conv_padded"]


def _rms(x3: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x3 * r, r)`` with ``r = rsqrt(mean(x3^2) + eps)`` over the last dim (the reference's ops)."""
    r = torch.rsqrt(x3.pow(2).mean(-1, keepdim=True) + eps)
    return x3 * r, r


def _rms_backward(
    dy: torch.Tensor, normed: torch.Tensor, r: torch.Tensor, scale: torch.Tensor, want_w: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For ``y = normed * scale`` (``normed = x * r`` grouped ``[T, G, H]``, ``scale = 1 + w [G, H]``):
    ``(dx [T, G, H], dw [G*H] or None)`` from ``dy [T, G, H]``."""
    dw = torch.linalg.vecdot(dy, normed, dim=0).flatten() if want_w else None
    dn = dy * scale
    mean = torch.linalg.vecdot(dn, normed, dim=-1).unsqueeze(-1).div_(normed.shape[-1])
    return dn.addcmul_(normed, mean, value=-1).mul_(r), dw


def _shifts(k: int, n: int) -> list[int]:
    """How far back tap ``j`` of a causal conv of ``k`` taps, dilation ``n``, reads: ``(k-1-j)*n``."""
    return [(k - 1 - j) * n for j in range(k)]


class _GateConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key, value, hidden, nk, nq, nc, cw, mask, geometry):
        b, s, hc, eps, dilation = geometry
        t, width = key.shape
        h = width // hc
        ctx.set_materialize_grads(False)
        sk, sq, sc = 1.0 + nk.view(hc, h), 1.0 + nq.view(hc, h), 1.0 + nc.view(hc, h)
        kr, rk = _rms(key.view(t, hc, h), eps)
        qr, rq = _rms(hidden.view(t, hc, h), eps)
        kn, qn = kr * sk, qr * sq
        match = (kn * qn).sum(dim=-1, keepdim=True) / math.sqrt(h)
        root = match.abs().clamp_min(1e-6).sqrt()
        gate = torch.sigmoid(root * match.sign())
        gated = gate * value.unsqueeze(-2)
        cr, rc = _rms(gated, eps)
        c = (cr * sc).view(b, s, width)
        v = gated.view(b, s, width)
        if mask is not None:
            v = v * mask
            c = c * mask
        k = cw.shape[1]
        x = F.pad(c.transpose(1, 2), ((k - 1) * dilation, 0))
        y = F.conv1d(x, cw.unsqueeze(1), groups=width, dilation=dilation)  # [B, C, S], as the reference
        out = v + F.silu(y).transpose(1, 2)
        y = y.transpose(1, 2)  # [B, S, C] (a view)
        taps = cw.t().contiguous()  # [K, C]: each tap's weights side by side (a strided column is slow)
        ctx.save_for_backward(value, kr, rk, qr, rq, kn, qn, match, root, gate, cr, rc, c, y, nk, nq, nc, taps, mask)
        ctx.geometry = geometry
        return out, c

    @staticmethod
    def backward(ctx, dout, dc_out):
        if NATIVE_BACKWARD:
            got = _native_backward(ctx, dout, dc_out)
            if got is not None:
                return got
        value, kr, rk, qr, rq, kn, qn, match, root, gate, cr, rc, c, y, nk, nq, nc, taps, mask = ctx.saved_tensors
        b, s, hc, eps, dilation = ctx.geometry
        t, width = b * s, hc * value.shape[1]
        h = width // hc
        need = ctx.needs_input_grad
        if dout is None:
            dout = torch.zeros(b, s, width, dtype=c.dtype)
        n_taps = taps.shape[0]
        back = _shifts(n_taps, dilation)
        dout = dout.contiguous()
        dy = torch.ops.aten.silu_backward.grad_input(dout, y, grad_input=torch.empty_like(dout))  # [B, S, C]
        dcw = None
        if need[6]:
            dtaps = torch.zeros_like(taps)
            for j, k in enumerate(back):
                if k < s:
                    dtaps[j] = torch.linalg.vecdot(dy[:, k:], c[:, : s - k], dim=1).sum(0)
            dcw = dtaps.t()
        dc = dy * taps[n_taps - 1]
        for j, k in enumerate(back[:-1]):
            if k < s:
                dc[:, : s - k].addcmul_(dy[:, k:], taps[j])
        if dc_out is not None:
            dc.add_(dc_out)
        dv = dout
        if mask is not None:
            dc.mul_(mask)
            dv = dout * mask
        sk, sq, sc = 1.0 + nk.view(hc, h), 1.0 + nq.view(hc, h), 1.0 + nc.view(hc, h)
        dgated, dnc = _rms_backward(dc.view(t, hc, h), cr, rc, sc, need[5])
        dgated.add_(dv.reshape(t, hc, h))
        dvalue = torch.linalg.vecdot(dgated, gate, dim=1) if need[1] else None
        dgate = torch.linalg.vecdot(dgated, value.unsqueeze(-2), dim=-1).unsqueeze(-1)
        # d sigmoid(root * sign(m)) / dm = sigmoid' * 0.5 / root where |m| >= 1e-6 (else the clamp holds it)
        dmatch = dgate * gate * (1 - gate) * (0.5 / root) * (match.abs() >= 1e-6) / math.sqrt(h)
        dk = dnk = dq = dnq = None
        if need[0] or need[3]:
            dk, dnk = _rms_backward(qn * dmatch, kr, rk, sk, need[3])
        if need[2] or need[4]:
            dq, dnq = _rms_backward(kn * dmatch, qr, rq, sq, need[4])
        return (
            None if dk is None or not need[0] else dk.view(t, width),
            dvalue,
            None if dq is None or not need[2] else dq.view(t, width),
            dnk,
            dnq,
            dnc,
            dcw,
            None,
            None,
        )


NATIVE_BACKWARD = True
"""Whether the backward runs as the C kernel where it takes the step (see :func:`_native_backward`);
False: the written-out PyTorch backward above (its reference in the tests)."""


def _native_backward(ctx, dout, dc_out):
    """The backward's gradients from ``ple_gate_conv_backward`` (``ple_train.c``): two passes over the
    rows instead of some forty operations over ``[T, HC*H]`` tensors, the same gradients within fp32
    rounding, the same bits for any thread count. None (nothing computed) where it does not take the
    step: the C library unavailable, a tensor off the CPU or not fp32, more than 64 heads, or code being
    traced (compiled or exported: the written-out operations are traced instead)."""
    from ple.kernels import native as _native

    if torch.compiler.is_compiling():
        return None
    saved = ctx.saved_tensors
    value, kr, rk, qr, rq, kn, qn, match, root, gate, cr, rc, c, y, nk, nq, nc, taps, mask = saved
    b, s, hc, eps, dilation = ctx.geometry
    f32 = torch.float32
    if hc > 64 or any(
        t is not None and (type(t) not in _PLAIN or t.device.type != "cpu" or t.dtype != f32)
        for t in (*saved, dout, dc_out)
    ):
        return None  # tensor subclasses (fake tensors, a dispatch mode's) included
    try:
        lib = _native.library()
    except _native.NativeUnavailable:
        return None
    t, h = b * s, value.shape[1]
    width = hc * h
    need = ctx.needs_input_grad
    if dout is None:
        dout = torch.zeros(t, width, dtype=f32)
    dout = dout.reshape(t, width).contiguous()
    dc_out = None if dc_out is None else dc_out.reshape(t, width).contiguous()
    if value.stride(1) != 1:
        value = value.contiguous()
    flat = [x.contiguous() for x in (kr, rk, qr, rq, kn, qn, match, root, gate, cr, rc, c)]
    m = None if mask is None else mask.reshape(t).contiguous()
    k = taps.shape[0]
    out = [
        torch.empty(t, width, dtype=f32) if need[0] else None,
        torch.empty(t, h, dtype=f32) if need[1] else None,
        torch.empty(t, width, dtype=f32) if need[2] else None,
        torch.empty(width, dtype=f32) if need[3] else None,
        torch.empty(width, dtype=f32) if need[4] else None,
        torch.empty(width, dtype=f32) if need[5] else None,
        torch.empty(k, width, dtype=f32) if need[6] else None,
    ]
    weights = [x.contiguous() for x in (nk, nq, nc, taps)]
    ptr = _ptr
    rc_code = lib.ple_gate_conv_backward(
        b, s, hc, h, k, dilation, dout.data_ptr(), ptr(dc_out), ptr(m), value.data_ptr(), value.stride(0),
        *(x.data_ptr() for x in flat), y.data_ptr(), *y.stride(), *(x.data_ptr() for x in weights),
        *(ptr(x) for x in out), int(need[0] or need[3]), int(need[2] or need[4]), torch.get_num_threads(),
    )  # fmt: skip
    if rc_code == -2:
        raise MemoryError("gate_conv backward: the C kernel could not allocate its scratch")
    if rc_code != 0:
        return None
    dk, dvalue, dq, dnk, dnq, dnc, dtaps = out
    return dk, dvalue, dq, dnk, dnq, dnc, None if dtaps is None else dtaps.t(), None, None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what the kernel reads by address (no fake or traced tensors)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def gate_conv_padded(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    gate: GateWeights,
    conv_weight: torch.Tensor,
    dilation: int,
    shape: tuple[int, int],
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v + silu(conv(c)), c)``, both ``[B, S, HC*H]`` fp32, of ``B`` fresh sequences of ``S`` tokens
    (see the module docstring).

    Args:
        key: ``[B*S, HC*H]`` fp32, the key projection; value ``[B*S, H]``; hidden ``[B*S, HC*H]``.
        gate: the gate's weights (``norm_key``, ``norm_query``, ``norm_conv`` ``[HC*H]``, eps, HC).
        conv_weight: ``[HC*H, K]`` the conv's taps; ``dilation``: the n-gram size.
        shape: ``(B, S)``.
        attention_mask: ``[B, S]`` (1 token, 0 padding) or None: padded positions' ``v`` and ``c`` are zero.
    """
    b, s = shape
    mask = None if attention_mask is None else attention_mask[:, :, None].to(torch.float32)
    geometry = (b, s, gate.hc_count, float(gate.eps), int(dilation))
    return _GateConv.apply(
        key, value, hidden, gate.norm_key, gate.norm_query, gate.norm_conv, conv_weight, mask, geometry
    )
