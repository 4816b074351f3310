"""`plait plan --memory-headroom`: the device memory a layout must leave unused.

The estimator counts the bytes a rank's tensors need at its peak; a device holds more than
that: the CUDA context and its kernels' images, NCCL's buffers per communicator and peer,
cuBLAS workspaces, and the caching allocator's reserved-but-unallocated blocks (fragments of
freed tensors too small for the next request). A layout estimated at 99% of the device
fails with an out-of-memory error in its first steps, so the planner keeps a headroom and
ranks a layout only when estimate + headroom <= device memory. The default, 10% of the
device (8 GiB of an 80 GiB H100), and why: docs/planning.md.

The flag takes a share of the device ("10%", or a bare "10") or a size ("6GiB"); its domain
is checked with every numeric flag (`plait.domain.check_parsed`), and a size larger than the
device is refused once the device's memory is known (`headroom_bytes`).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from plait.domain import Domain, Unparsed
from plait.errors import ConfigError
from plait.plan.hardware import parse_size

DEFAULT = "10%"
"""The documented default: 10% of device memory (docs/planning.md says why)."""


class Size(int):
    """A headroom given as bytes ('6GiB'), as opposed to a share of the device."""


class HeadroomDomain(Domain):
    """A percentage in [0, 100) of device memory, or a size: argparse's type and the check."""

    def __init__(self) -> None:
        super().__init__(float, 0.0, 100.0, high_open=True)

    def __call__(self, text: str) -> Any:
        """'10%' or '10' -> 10.0 (percent); '6GiB' -> Size(bytes); anything else Unparsed."""
        body = str(text).strip()
        share = body.removesuffix("%").strip()
        try:
            return float(share)
        except ValueError:
            pass
        if re.search(r"[A-Za-z]\s*$", body):
            try:
                return Size(parse_size(body))
            except ConfigError:
                return Unparsed(text)
        return Unparsed(text)

    def problem(self, value: Any) -> str | None:
        if isinstance(value, Size):
            return None  # parse_size refused <= 0; the device's size is checked later
        if isinstance(value, float) and math.isfinite(value) and 0 <= value < 100:
            return None
        return "must be a share of device memory in [0, 100)% (e.g. 10%) or a size (e.g. 6GiB)"


HEADROOM = HeadroomDomain()


def headroom_bytes(value: float | int, memory: int) -> int:
    """The bytes kept free on a device of `memory` bytes: a percent of it, or a size that
    must be less than it (else nothing could fit, and the planner would say so about every
    layout instead of naming the flag)."""
    if isinstance(value, Size):
        if value >= memory:
            raise ConfigError(
                f"--memory-headroom {value / 2**30:,.3f} GiB is not less than the device's "
                f"{memory / 2**30:,.3f} GiB: nothing could fit; give less, or a percentage"
            )
        return int(value)
    return int(memory * value / 100)


def add_headroom_flag(parser: argparse.ArgumentParser, when: str = "") -> None:
    """`--memory-headroom` as `plait plan` and `plait estimate` both take it: one declaration,
    so its values, default and help cannot drift apart between the two commands."""
    parser.add_argument(
        "--memory-headroom",
        type=HEADROOM,
        default=HEADROOM(DEFAULT),
        help=f"{when}device memory to leave free: a share (10%%) or a size (6GiB); "
        f"default {DEFAULT.replace('%', '%%')} (docs/planning.md)",
    )
