"""The curves of compare_memory_traces_in_plot (matplotlib axes, numpy masked arrays): forward
and backward traces as two curves over the trace index, memory in gigabytes."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np


class MemoryGraphCreator:
    def __init__(self) -> None:
        import matplotlib

        self.font = {"family": matplotlib.rcParams["font.family"], "weight": "normal", "size": 12}

    def allocated_memory_curve(self, ax: Any, job_name: str, traces: List[Any]) -> None:
        values = [t.allocated for t in traces]
        self._plot(ax, job_name, traces, values)
        self._label_peak(ax, traces, values, lambda t: "fwd" if t.is_forward else "bwd")

    def reserved_memory_curve(self, ax: Any, job_name: str, traces: List[Any]) -> None:
        self._plot(ax, job_name, traces, [t.reserved for t in traces])

    def activation_allocations(self, ax: Any, job_name: str, traces: List[Any]) -> None:
        self._plot(ax, job_name, traces, [t.event.memory_activations for t in traces])

    def cumulative_activations(self, ax: Any, job_name: str, traces: List[Any]) -> None:
        x, forward, _ = _split(traces, [t.event.memory_activations for t in traces])
        ax.plot(x, np.cumsum(forward), label=job_name)
        _gigabytes(ax)

    def all_gathered_memory(self, ax: Any, job_name: str, traces: List[Any]) -> None:
        self._plot(ax, job_name, traces, [t.all_gathered for t in traces])
        cumulative = [t.cumul_all_gathered for t in traces]
        ax.plot(np.arange(len(traces)), cumulative, label=job_name)
        self._label_peak(ax, traces, cumulative, lambda t: "fwd")

    def module_parameters(self, ax: Any, job_name: str, traces: List[Any]) -> None:
        self._plot(ax, job_name, traces, [t.module_params for t in traces])

    def _plot(self, ax: Any, job_name: str, traces: List[Any], values: Sequence[int]) -> None:
        x, forward, backward = _split(traces, values)
        ax.plot(x, forward, x, backward, label=job_name)
        _gigabytes(ax)

    def _label_peak(self, ax: Any, traces: List[Any], values: Sequence[int], phase: Any) -> None:
        """Name the module at the curve's peak (private name parts left out)."""
        if not traces:
            return
        i = int(np.argmax(values))
        module = ".".join(n for n in traces[i].module_name.split(".") if not n.startswith("_"))
        peak = values[i]
        if peak > 0:
            ax.set_ylim([None, peak * 1.1])
        ax.text(max(0, i * 0.8), peak * 1.04, f"{module} ({phase(traces[i])})", fontdict=self.font)


def _gigabytes(ax: Any) -> None:
    ax.ticklabel_format(axis="y", style="sci", scilimits=(9, 9))


def _split(traces: List[Any], values: Sequence[int]) -> Tuple[np.ndarray, Any, Any]:
    """x, the forward traces' values (backward ones masked), the backward traces' values."""
    forward = np.array([t.is_forward for t in traces], dtype=bool)
    return np.arange(len(traces)), np.ma.masked_where(~forward, values), np.ma.masked_where(forward, values)
