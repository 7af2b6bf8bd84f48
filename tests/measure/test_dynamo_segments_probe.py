"""What torch._dynamo gives a capture path over its graph breaks (issue 24, item 2), with the torch installed.

A capture made of the graphs dynamo produces between graph breaks would need (1) graphs for a loop of layers that
branches on a tensor's value, and (2) those graphs to keep running while autockpt's tracer and MemTracker (both
``TorchDispatchMode``s) measure the step. Neither holds on torch 2.13: a graph break inside a loop skips the whole
frame (no graph at all), and one step under a dispatch mode leaves the frame's code running eagerly from then on
(unless the mode declares ``ignore_compile_internals()``; MemTracker does not).
These tests pin that (experiments/probes/probe_dynamo_segments.py measures it with the floors): when one of them starts
failing after a torch upgrade, the capture path becomes possible.
"""

from __future__ import annotations

import torch

import experiments.probes.probe_dynamo_segments as probe


def test_a_branch_inside_a_loop_of_layers_gives_dynamo_no_graph() -> None:
    torch.manual_seed(0)
    for model in (probe.LinearLoop(8, 3), probe.DropoutLoop(8, 3)):
        graphs, _, _ = probe.dynamo_graphs(model, (torch.randn(4, 8),))
        assert graphs == [], f"{type(model).__name__}: dynamo now makes graphs {graphs}: see issue 24 item 2"


def test_dynamo_graphs_stop_running_after_a_step_under_a_plain_dispatch_mode() -> None:
    torch.manual_seed(0)
    graphs, run_under_ignoring, run_after = probe.dynamo_graphs(probe.BranchThenLoop(8, 3), (torch.randn(4, 8),))
    assert len(graphs) >= 2 and max(graphs) >= 2 * 3  # the loop's 3 Linear-tanh layers in one graph
    assert run_under_ignoring > 0  # a mode declaring ignore_compile_internals() keeps them running (and sees them)
    assert run_after == 0, "dynamo now keeps running its graphs after a dispatch-mode step: see issue 24 item 2"
