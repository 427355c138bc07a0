"""Stand-ins for quantized weights that fake tensors cannot hold (bitsandbytes' 4-bit ``Params4bit``).

A ``Params4bit`` is a tensor subclass whose quantization state (per-block scales, the code book,
nested scales) lives in a Python object beside it; a fake copy of it cannot be made. For the
estimate, each ``Linear4bit`` of a model built for real is replaced by a ``QuantizedLinear``
that holds the same storage by dtype (the packed uint8 weight and every tensor of its quantization
state, as plain tensors the fake copy turns into fake ones) and runs its step as bitsandbytes'
``MatMul4Bit`` does: forward and backward each dequantize the weight into a transient of its full
shape in the compute dtype, multiply, and let it go; only the packed weight is saved for backward.
Whether bitsandbytes' kernel on a given device dequantizes the whole weight or fuses it, the
stand-in cannot tell: the estimate says it is unverified.
"""

from __future__ import annotations

import types

import torch


def is_quantized_4bit(tensor) -> bool:
    """A bitsandbytes 4-bit weight (matched by name: bitsandbytes need not import here)."""
    return type(tensor).__name__ == "Params4bit" and getattr(tensor, "quant_state", None) is not None


def quant_state_tensors(state) -> list[torch.Tensor]:
    """Every tensor of a bitsandbytes ``QuantState``, nested states (``state2``) included."""
    found = []
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value).__name__ == "QuantState":
            found += quant_state_tensors(value)
    return found


class _Dequantizing(torch.autograd.Function):
    """``x @ W.T + bias`` with W made from the packed weight in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, packed, bias, shape, dtype):
        ctx.save_for_backward(packed)
        ctx.shape, ctx.dtype, ctx.bias = shape, dtype, bias is not None and bias.requires_grad
        weight = x.new_empty(shape, dtype=dtype).to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight = grad.new_empty(ctx.shape, dtype=ctx.dtype).to(grad.dtype)
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad.sum(0) if ctx.bias else None
        return grad_x, None, grad_bias, None, None


class QuantizedLinear(torch.nn.Module):
    """A ``Linear4bit``'s storage and step on fake tensors (see the module docstring)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        state = layer.weight.quant_state
        # The packed bytes, frozen as in the real layer (a Params4bit never trains).
        self.weight = torch.nn.Parameter(layer.weight.data.detach(), requires_grad=False)
        self.bias = layer.bias
        for index, tensor in enumerate(quant_state_tensors(state)):
            self.register_buffer(f"quant_state_{index}", tensor, persistent=False)
        self.shape = tuple(state.shape)
        self.dtype = state.dtype
        self.compute_dtype = getattr(layer, "compute_dtype", None)
        self._mark_weight()

    def __setstate__(self, state):
        # A deep copy (the fake copy) rebuilds the module through here, with a new weight.
        super().__setstate__(state)
        self._mark_weight()

    def _mark_weight(self):
        # Where parameters are counted in weights, not bytes (the plan's param_count): the shape
        # before packing, where bitsandbytes keeps it.
        self.weight.quant_state = types.SimpleNamespace(shape=self.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return _Dequantizing.apply(x, self.weight, bias, self.shape, self.dtype).to(given)


def replace_quantized(model: torch.nn.Module) -> int:
    """Replace every module holding a 4-bit weight by a ``QuantizedLinear``, in place; how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Its own parameter: peft's wrapper shows its base layer's weight as a property.
            if is_quantized_4bit(child._parameters.get("weight")):
                setattr(parent, name, QuantizedLinear(child))
                replaced += 1
    return replaced


__all__ = ["QuantizedLinear", "is_quantized_4bit", "quant_state_tensors", "replace_quantized"]
