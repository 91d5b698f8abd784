"""Emulating the full model on a pack with fewer decoder layers (`--emulate-layers L_full`).

A pack cut to L of the model's L_full layers (`flashpack synth full --layers 4`) has the full
model's dimensions, so one layer costs what it would in the full model; only the count differs.
The budgets the user types are for the full model. Each splits into a fixed part (what does not
grow with the layer count; see sizes.py) and a per-layer part, and the per-layer part is scaled
to the pack:

    scaled_budget = fixed + (budget - fixed) * L / L_full

so every layer gets the share of device slots and host cache it would get in the full model. The
same split, the other way round, scales what one token costs back up to L_full layers:

    x(L_full) = x_fixed + (x(L) - x_fixed) * L_full / L

for seconds (x_fixed: embedding, final mixer and lm_head timed alone) and for bytes (x_fixed: the
dense bytes read outside the layers; experts and store traffic are all per layer). That counts
everything a step does outside those three as per layer, the step's host work included (the PLE
rows, the first graph launch, the read-back), so where decode runs from CUDA graphs the bench
measures the layers' own share instead, the device's time from the first layer's work to the
last's (t_layers), and scales only that:

    t(L_full) = t(L) + t_layers(L) * (L_full - L) / L

That still counts the pack's first layer, which is not like the rest, once per L of the full
model's layers: layer 0 (no layer before it predicts its experts, and in the full model it is the
PLE layer, the only one). Where each layer was timed on its own (one CUDA graph a layer), the layers
past the pack's are therefore counted by kind instead:

    t(L_full) = t(L) + sum over j = L .. L_full - 1 of t_kind(j)

t_kind being the mean time of the pack's layers of that kind (DeltaNet or attention) past layer 0
and without PLE; layer j's kind continues the pack's attention pattern (every `period`-th layer,
the period read off the pack) and it has no PLE (true of the full model, whose PLE layer is layer 0).
The dense bytes the roofline counts for those layers are found the same way. Expert traffic stays
scaled evenly: every layer routes top-k experts.

All three are reported; the even and t_layers ones are kept for comparison with earlier runs.
Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flashpack.errors import FlashpackError
from flashpack.runtime.bench.roofline import Traffic
from flashpack.runtime.store.budget import format_bytes

BUDGET_FORMULA = "scaled_budget = fixed + (budget - fixed) * L / L_full"
SCALE_FORMULA = "x(L_full) = x_fixed + (x(L) - x_fixed) * L_full / L"
LAYER_TIME_FORMULA = "t(L_full) = t(L) + t_layers(L) * (L_full - L) / L"
LAYER_KIND_FORMULA = ("t(L_full) = t(L) + sum over layers j = L .. L_full - 1 of t_kind(j), t_kind the mean time "
                      "of the pack's layers of j's kind (DeltaNet or attention) past layer 0 and without PLE")


@dataclass(frozen=True)
class LayerKinds:
    """What each decoder layer is timed as: the pack's ("first", "ple", "deltanet", "attention") and,
    where the pack shows its attention pattern, the full model's layers past them ("deltanet" or
    "attention"; `tail` is None where the pattern cannot be read off the pack)."""

    pack: tuple[str, ...]
    tail: tuple[str, ...] | None

    @classmethod
    def of(cls, linear: Sequence[bool], ple: Sequence[bool], full_layers: int) -> LayerKinds:
        """From the pack's layers' types (`linear[i]`: DeltaNet, else attention) and PLE flags."""
        kinds = tuple("first" if i == 0 else "ple" if ple[i] else "deltanet" if linear[i] else "attention"
                      for i in range(len(linear)))
        period = list(linear).index(False) + 1 if not all(linear) else None
        if period is None or any(linear[i] != bool((i + 1) % period) for i in range(len(linear))):
            return cls(kinds, None)
        return cls(kinds, tuple("deltanet" if (j + 1) % period else "attention"
                                for j in range(len(linear), full_layers)))

    def tail_sum(self, per_layer: Mapping[int, float]) -> float | None:
        """The sum over the full model's layers past the pack's of the mean of `per_layer` (one value
        for each of the pack's layers) over the pack's layers of the same kind; None where the tail
        is unknown, a layer's value is missing or the pack has no layer of a kind the tail needs."""
        if self.tail is None or set(per_layer) != set(range(len(self.pack))):
            return None
        means = {}
        for kind in set(self.tail):
            values = [per_layer[i] for i, k in enumerate(self.pack) if k == kind]
            if not values:
                return None
            means[kind] = sum(values) / len(values)
        return sum(means[kind] for kind in self.tail)


def check_layers(pack_layers: int, full_layers: int | None) -> int:
    """The layer count the typed budgets are for (L_full, or the pack's own count)."""
    if full_layers is None:
        return pack_layers
    if full_layers < pack_layers:
        raise FlashpackError(
            f"--emulate-layers {full_layers} is fewer than the pack's {pack_layers} decoder layers"
        )
    return full_layers


def scale_budget(budget: int | None, fixed: int, layers: int, full_layers: int, flag: str) -> int | None:
    """A full-model budget (bytes) scaled to `layers` of `full_layers`; None stays None."""
    if budget is None or layers == full_layers:
        return budget
    if budget < fixed:
        raise FlashpackError(
            f"{flag} {format_bytes(budget)} is below the {format_bytes(fixed)} the model keeps outside its "
            f"layers, so no room is left for {full_layers} layers"
        )
    return fixed + (budget - fixed) * layers // full_layers


def scaled_budgets(
    typed: dict[str, int | None], device_fixed: int, layers: int, full_layers: int,
) -> tuple[dict[str, int], dict[str, int | None]]:
    """Typed full-model budgets {"vram", "ram"} -> (their fixed parts, the budgets for the pack's
    `layers`); the RAM budget has no fixed part (the host cache holds experts alone)."""
    fixed = {"vram": device_fixed, "ram": 0}
    return fixed, {tier: scale_budget(typed[tier], fixed[tier], layers, full_layers, f"--{tier}-budget")
                   for tier in ("vram", "ram")}


def scale_to_layers(value: float, fixed: float, layers: int, target_layers: int) -> float:
    """A cost measured with `layers` layers (of which `fixed` does not depend on them) at `target_layers`."""
    return fixed + (value - fixed) * target_layers / layers


def scale_by_layer_time(total: float, in_layers: float, layers: int, target_layers: int) -> float:
    """A step time measured with `layers` layers, `in_layers` of it in the layers, at `target_layers`."""
    return total + in_layers * (target_layers - layers) / layers


def scale_traffic(traffic: Traffic, fixed_device: float, layers: int, target_layers: int,
                  layer_dense: tuple[float, float] | None = None) -> Traffic:
    """Bytes at `target_layers`: the device's fixed part stays, the rest (dense layer weights,
    experts, store copies and reads) scales with the layer count. `layer_dense`: the dense bytes
    the pack's layers read in the phase and those the full model's would (LayerKinds.tail_sum), so
    they are counted as they are rather than scaled with the rest."""
    if layer_dense is not None:
        pack_dense, full_dense = layer_dense
        device = fixed_device + full_dense + (traffic.device - fixed_device - pack_dense) * target_layers / layers
    else:
        device = scale_to_layers(traffic.device, fixed_device, layers, target_layers)
    return Traffic(
        device,
        traffic.host_to_device * target_layers / layers,
        traffic.disk_to_host * target_layers / layers,
    )
