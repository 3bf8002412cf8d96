"""Gate, then mask, then conv: the composition shared by the reference, PyTorch and Triton twins."""

from __future__ import annotations

from ...errors import InvalidArgumentError


def compose(
    gate_fn,
    conv_fn,
    key,
    value,
    hidden,
    norm_key_weight,
    norm_query_weight,
    norm_conv_weight,
    eps,
    hc_count,
    conv_weight,
    dilation,
    query_start_loc,
    conv_state,
    state_indices,
    has_initial_state,
    num_rejected=None,
    *,
    token_mask=None,
    add_hidden=True,
    return_conv_input=False,
    validate=True,
):
    check_token_mask(token_mask, value.shape[0])
    v, c = gate_fn(key, value, hidden, norm_key_weight, norm_query_weight, norm_conv_weight, eps, hc_count)
    if token_mask is not None:
        m = token_mask.to(v.dtype).unsqueeze(1)
        v = v * m
        c = c * m
    out = conv_fn(
        c,
        conv_weight,
        dilation,
        query_start_loc,
        conv_state,
        state_indices,
        has_initial_state,
        num_rejected,
        residual=v.add_(hidden) if add_hidden else v,
        validate=validate,
    )
    return (out, c) if return_conv_input else out


def check_token_mask(token_mask, tokens: int) -> None:
    if token_mask is not None and tuple(token_mask.shape) != (tokens,):
        raise InvalidArgumentError(f"gate_conv: token_mask.shape={tuple(token_mask.shape)}, expected [T]=({tokens},)")
