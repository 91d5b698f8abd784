"""The roofline of a phase: the time its bytes need at the machine's bandwidths, tier by tier.

Three tiers move bytes for a token:

    device          what the compute reads from device memory: every dense weight once per
                    forward (the layers', lm_head and the final mixer), one embedding row per
                    token, and each expert record the router picked (its NVFP4 bytes, once per
                    forward that uses it)
    host_to_device  expert records copied from the host cache into device slots (store counters)
    disk_to_host    expert records read from the pack (store counters)

The roofline time is the slowest tier's bytes / bandwidth (tiers overlap at best: copies and reads
run beside the compute); a tier whose bandwidth is unknown (host->device on a CPU) is left out.
`achieved_over_roofline` = roofline time / measured time = achieved tok/s / roofline tok/s (1.0
would be the bandwidth limit). The serial time (sum over tiers) is reported beside it: the bound
if nothing overlapped. No compute ceiling is modelled: a prefill far above its roofline is
compute-bound, not slow on bytes. Pure functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TIERS = ("device", "host_to_device", "disk_to_host")


@dataclass(frozen=True)
class Traffic:
    """Bytes moved through each tier (over a phase, or per token)."""

    device: float
    host_to_device: float
    disk_to_host: float

    def per_token(self, tokens: int) -> Traffic:
        return Traffic(self.device / tokens, self.host_to_device / tokens, self.disk_to_host / tokens)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def phase_traffic(sizes, *, forwards: int, tokens: int, requests: int, host_to_device: int,
                  disk_to_host: int) -> Traffic:
    """Bytes of a phase of `forwards` forward calls over `tokens` tokens in which the MoE blocks
    requested `requests` experts (summed over layers and calls); `sizes` is a ModelSizes."""
    device = forwards * sizes.per_forward_read + tokens * sizes.embed_row + requests * sizes.record_bytes
    return Traffic(float(device), float(host_to_device), float(disk_to_host))


def roofline(traffic: Traffic, bandwidth: dict[str, float | None], tokens: int,
             achieved_seconds: float | None = None) -> dict:
    """Per-tier seconds (bytes / bytes-per-second), the bound, and how close `achieved_seconds` came.

    `traffic` is the whole phase's bytes over `tokens` tokens; `bandwidth` maps each tier to bytes
    per second (None: unknown, the tier is left out)."""
    bytes_ = traffic.to_dict()
    seconds = {tier: (bytes_[tier] / bandwidth[tier] if bandwidth.get(tier) else None) for tier in TIERS}
    known = {tier: s for tier, s in seconds.items() if s is not None}
    if not known:
        raise ValueError("no tier has a known bandwidth")
    bound = max(known, key=known.get)
    limit = known[bound]
    out = {
        "tokens": tokens,
        "bytes": bytes_,
        "bytes_per_token": traffic.per_token(tokens).to_dict(),
        "bandwidth": {tier: bandwidth.get(tier) for tier in TIERS},
        "seconds": seconds,
        "bound": bound,
        "roofline_seconds": limit,
        "roofline_seconds_per_token": limit / tokens,
        "roofline_tokens_per_s": tokens / limit if limit > 0 else None,
        "serial_seconds": sum(known.values()),
        "achieved_seconds": achieved_seconds,
        "achieved_tokens_per_s": None,
        "achieved_over_roofline": None,
    }
    if achieved_seconds:
        out["achieved_tokens_per_s"] = tokens / achieved_seconds
        out["achieved_over_roofline"] = limit / achieved_seconds
    return out
