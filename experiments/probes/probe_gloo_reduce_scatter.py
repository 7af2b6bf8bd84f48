"""What gloo's ``reduce_scatter_tensor`` allocates beside its input and output (issue 48's FSDP gap on CPU): two gloo
ranks, one call on a float32 input of ``INPUT_ELEMENTS`` elements, torch's MemTracker around it (the input and
output tracked as existing before). FSDP2 reduce-scatters each unit's gradients after its backward; the fake process
group the FSDP planner measures on allocates nothing there (NCCL's reduce-scatter works in its own buffers, outside
PyTorch's allocator), so on gloo a peak at a reduce-scatter is above the prediction by what this finds.

    python -m experiments.probes.probe_gloo_reduce_scatter --out experiments/results/fsdp
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.common.results_readme import write_section

INPUT_ELEMENTS = 4 * 2**20  # 16,777,216 B of float32
WORLD = 2


def _rank(rank: int, world: int, folder: str) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    try:
        source = torch.randn(INPUT_ELEMENTS)
        output = torch.empty(INPUT_ELEMENTS // world)
        tracker = MemTracker()
        tracker.track_external(source, output)
        with tracker:
            dist.reduce_scatter_tensor(output, source, async_op=True).wait()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        with open(f"{folder}/rank{rank}.pkl", "wb") as handle:
            pickle.dump({str(getattr(k, "value", k)): int(v) for k, v in peak.items()}, handle)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/fsdp"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(WORLD, folder), nprocs=WORLD, join=True)
        peaks = [pickle.loads((Path(folder) / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    input_bytes, output_bytes = INPUT_ELEMENTS * 4, INPUT_ELEMENTS * 4 // WORLD
    lines = [(f"`python -m experiments.probes.probe_gloo_reduce_scatter --out {args.out}`: one "
              f"`reduce_scatter_tensor` on {WORLD} gloo ranks (CPU), a float32 input of {input_bytes} B and an output "
              f"of {output_bytes} B tracked as existing before (MemTracker's 'Other'); its peak by category on each "
              "rank:"), ""]
    for rank, peak in enumerate(peaks):
        made = peak["Total"] - input_bytes - output_bytes
        lines.append(f"- rank {rank}: {peak}; allocated by the call: {made} B ({made / input_bytes:.2f} x the input)")
    text = "\n".join(lines)
    print(text)
    write_section("probe_gloo_reduce_scatter", text, output=args.out)


if __name__ == "__main__":
    main()
