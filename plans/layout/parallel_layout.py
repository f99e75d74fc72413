"""ParallelLayout: how the world of ranks is split into pp x dp x fsdp x tp (and experts over ep).

Rank order puts tp innermost (neighbouring ranks share a node, where tensor parallelism's
frequent collectives belong), then fsdp, then dp, with pp outermost — the same order as the
device mesh the actors build, so `coords_of(rank)` equals the rank's mesh coordinates.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.options import option

# The device mesh's dims, outermost first (the rank order below).
MESH_DIM_NAMES = ("pp", "dp", "fsdp", "tp")
# The dims inside one pipeline stage: a stage's tensors are sharded or copied along these.
STAGE_MESH_DIMS = ("dp", "fsdp", "tp")
# The data-parallel dims FSDP2 shards and replicates over (HSDP: dp replicas of fsdp shards).
DATA_MESH_DIMS = ("dp", "fsdp")
# The parallel degrees in the order people write them (`dp2 x tp2`, `--dp 2 --tp 2`), and with vpp
# and ep every field of a layout. vpp and ep multiply no ranks: vpp cuts a pp rank's layers into
# virtual stages, ep splits the experts of a mixture-of-experts model over the fsdp ranks.
PARALLEL_DEGREES = ("dp", "fsdp", "tp", "pp")
LAYOUT_DEGREES = (*PARALLEL_DEGREES, "vpp", "ep")


@dataclass(frozen=True)
class RankCoords:
    pp: int
    dp: int
    fsdp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    """dp: replicas (gradients all-reduced); fsdp: sharded data parallel (FSDP2);
    tp: tensor parallel (DTensor); pp: pipeline stages; vpp: virtual stages per pp rank;
    ep: expert parallel, 1 or fsdp: a mixture-of-experts model's experts split over the fsdp ranks,
    tokens sent to them by all-to-all (docs/decisions.md 71 says why ep borrows exactly fsdp)."""

    dp: int = option(1, metavar="N", help="dp degree")
    fsdp: int = option(1, metavar="N", help="fsdp degree")
    tp: int = option(1, metavar="N", help="tp degree")
    pp: int = option(1, metavar="N", help="pp degree")
    vpp: int = option(1, metavar="N", help="vpp degree")
    ep: int = option(1, metavar="N", help="ep degree")

    def __post_init__(self):
        for field in LAYOUT_DEGREES:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(field, value, "every parallel degree must be an integer >= 1",
                                  f"set --{field} to 1 or more")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("vpp", self.vpp, "virtual pipeline stages need pp > 1",
                              "set --vpp 1, or --pp 2 or more")
        if self.ep not in (1, self.fsdp):
            raise ConfigError("ep", self.ep, f"expert parallelism splits the experts over the fsdp ranks, so ep must "
                              f"be 1 or equal fsdp (here {self.fsdp})", f"set --fsdp {self.ep} (moving ranks from dp), or --ep 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: replicas times shards."""
        return self.dp * self.fsdp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.fsdp, self.tp)

    def coords_of(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        rank, tp = divmod(rank, self.tp)
        rank, fsdp = divmod(rank, self.fsdp)
        pp, dp = divmod(rank, self.dp)
        return RankCoords(pp=pp, dp=dp, fsdp=fsdp, tp=tp)

    def rank_of(self, coords: RankCoords) -> int:
        return ((coords.pp * self.dp + coords.dp) * self.fsdp + coords.fsdp) * self.tp + coords.tp

    def data_rank_of(self, rank: int) -> int:
        """Index of this rank's slice of the global batch (equal for tp and pp peers)."""
        coords = self.coords_of(rank)
        return coords.dp * self.fsdp + coords.fsdp

    def describe(self) -> str:
        parts = [f"{name}{getattr(self, name)}" + (f"(ep{self.ep})" if name == "fsdp" and self.ep > 1 else "")
                 for name in PARALLEL_DEGREES if getattr(self, name) > 1]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        return " x ".join(parts) or "single rank"

    def to_dict(self) -> dict:
        # ep only where used: the metadata of every dense run (and its comparisons) stays as it was.
        data = asdict(self)
        if self.ep == 1:
            del data["ep"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelLayout":
        return cls(**{key: int(data[key]) for key in LAYOUT_DEGREES if key in data})

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """Parse 'dp=2,tp=2' (the form used by --to and in messages). Strict: an empty text, an
        empty item or a degree given twice is an error, not a guess (`dp=1,dp=2` took the last)."""
        fix = "write it as dp=N,fsdp=N,tp=N,pp=N,vpp=N,ep=N (any subset, each once; degrees left out are 1)"
        if not text.strip():
            raise ConfigError("layout", text, "is empty", fix)
        values = {}
        for part in (p.strip() for p in text.split(",")):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in LAYOUT_DEGREES or not value.strip().isdigit():
                raise ConfigError("layout", text, f"cannot read {part!r}" if part else "has an empty item", fix)
            if key in values:
                raise ConfigError("layout", text, f"gives {key} twice", fix)
            values[key] = int(value)
        return cls(**values)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.to_dict().items())
