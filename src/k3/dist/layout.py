"""The parallel layout of a training run (issue 17; SPEC §8): how ``world`` processes split the work.

Four factors whose product is the world size (torchtitan's names; the mesh orders them ``dp_replicate, ep, dp_shard,
cp`` so that the ranks sharing experts, ``dp_shard × cp``, are one contiguous block of the mesh):

* ``dp_replicate`` — replicas of the whole model (HSDP's outer dimension); each sees different data.
* ``dp_shard`` — FSDP2 shards: parameters, gradients and optimiser states split; each sees different data.
* ``ep`` — expert parallelism: routed experts split over ``ep`` ranks (MoonEP), each rank's experts FSDP-sharded over
  ``dp_shard × cp``; these ranks also see different data (each holds its own tokens and exchanges them with the
  others' experts by all-to-all), and the non-expert parameters are FSDP-sharded over them too.
* ``cp`` — context parallelism: one sequence cut into ``cp`` contiguous segments, one per rank.

Data ranks: ``dp_replicate × dp_shard × ep`` (the batch is split over them); every rank of a ``cp`` group holds the
same batch rows, a different segment of each. `ParallelLayout.validate` checks a layout against the world size and a
model before any process group exists; every error names the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3.config import K3Config

#: The mesh's dimension names, outermost first (`ParallelLayout.shape`).
MESH_DIMS = ("dp_replicate", "ep", "dp_shard", "cp")
FLAGS = {name: "--" + name.replace("_", "-") for name in MESH_DIMS}


@dataclass(frozen=True)
class ParallelLayout:
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1

    @classmethod
    def for_world(cls, world: int, dp_replicate: int | None = None, dp_shard: int | None = None,
                  ep: int | None = None, cp: int | None = None) -> ParallelLayout:
        """The layout for ``world`` processes; an omitted ``dp_shard`` takes what the other factors leave (as
        torchtitan's ``-1``), the others default to 1. Raises ValueError naming the flag at fault."""
        given = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "ep": ep, "cp": cp}
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"--nproc = {world!r} is invalid: must be a positive integer")
        for name, value in given.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{FLAGS[name]} = {value!r} is invalid: must be a positive integer")
        if dp_shard is None:
            rest = (dp_replicate or 1) * (ep or 1) * (cp or 1)
            if world % rest:
                raise ValueError(f"--dp-replicate × --ep × --cp = {rest} does not divide the world size {world}")
            dp_shard = world // rest
        layout = cls(dp_replicate or 1, dp_shard, ep or 1, cp or 1)
        if layout.world != world:
            raise ValueError(f"--dp-replicate {layout.dp_replicate} × --dp-shard {layout.dp_shard} × --ep {layout.ep} "
                             f"× --cp {layout.cp} = {layout.world}, but the world size (--nproc) is {world}")
        return layout

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh's shape, in `MESH_DIMS` order."""
        return self.dp_replicate, self.ep, self.dp_shard, self.cp

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.ep * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks that see different batch rows: ``dp_replicate × dp_shard × ep``."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def validate(self, config: K3Config, seq_lens: list[int] | None = None) -> ParallelLayout:
        """Check the layout against a model (``ep`` divides the routed experts and needs a MoE) and, when given,
        the sequence lengths of the curriculum stages (``cp`` needs sequences of at least ``cp`` tokens; the batch
        against the data ranks is `k3.train.distributed.check_layout`'s). Raises ValueError naming the flag."""
        if self.ep > 1:
            if "moe" not in config.ffn_kinds():
                raise ValueError(f"--ep {self.ep}: this model has no routed experts (no MoE layer)")
            if config.moe.num_experts % self.ep:
                raise ValueError(f"--ep {self.ep} does not divide the {config.moe.num_experts} routed experts")
        for length in seq_lens or []:
            if length < self.cp:
                raise ValueError(f"--cp {self.cp}: sequences of {length} tokens cannot be cut into {self.cp} segments")
        return self

    def describe(self) -> str:
        return " × ".join(f"{name} {size}" for name, size in zip(MESH_DIMS, self.shape))
