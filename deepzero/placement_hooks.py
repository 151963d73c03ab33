"""A built model moved onto a ``Placement`` (``deepzero.placement``): each mapped module on its card, with a forward
pre-hook that carries its inputs there, so forward, backward and ``generate`` cross the cards unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepzero.errors import UserError
from deepzero.placement import Placement, torch_device


def _to_device(obj: Any, device: torch.device) -> Any:
    """Move tensors inside (nested) tuples, lists and dicts to ``device``; leave everything else (caches) alone."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        moved = [_to_device(o, device) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else tuple(moved)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def apply_placement(model: nn.Module, placement: Placement) -> nn.Module:
    """Move an already-built model's modules per ``placement.device_map`` and make forward cross the cards.

    Each mapped module is moved with ``.to(device)`` (parameters keep their identity, so an optimizer built
    before or after still holds the live tensors) and gets a forward pre-hook that moves its tensor inputs to
    its device. Autograd carries gradients back across devices, so forward → ``loss.backward()`` →
    ``optimizer.step()`` and ``generate`` work unchanged. Works with repeated "cpu" devices (tests).
    Applying again replaces the previous hooks.
    """
    missing = sorted(
        {
            name
            for name, _ in [*model.named_parameters(), *model.named_buffers()]
            if not any(name == key or name.startswith(key + ".") for key in placement.device_map)
        }
    )
    if missing:
        raise UserError(
            "apply_placement",
            f"{len(missing)} tensors not in the device_map (e.g. {missing[0]})",
            "plan from this model's config",
        )
    for handle in getattr(model, "_deepzero_placement_hooks", []):
        handle.remove()
    handles = []
    for name, device in placement.device_map.items():
        module, target = model.get_submodule(name), torch_device(device)
        module.to(target)

        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict, target: torch.device = target) -> tuple[tuple, dict]:
            return _to_device(args, target), _to_device(kwargs, target)

        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
    model._deepzero_placement_hooks = handles
    model.hf_device_map = dict(placement.device_map)
    return model
