"""Cluster topology x model size -> FasterTransformer placement and GPU-memory plan.

Three jobs, used by ``model-loader run`` (before anything is written) and ``model-loader plan``:

* :func:`check_placement`: the FasterTransformer backend's rules (``docs/fastertransformer.md``, "Instances") and the
  chart's node rule. A Triton replica sees ``G`` GPUs (``--gpus-per-replica``, default T x P);
  FT needs ``G`` divisible by T x P and ``G <= T x P x I`` (every visible GPU gets an instance),
  ``n_layer`` divisible by P, and the replicas of a node must fit its GPUs (N x G <= node GPUs).
* :func:`estimate_memory`: bytes per GPU: the FT weights of one rank (loaded once per GPU and
  shared by the instances placed on it) plus, per instance placed on the GPU, its working
  memory: the KV cache for ``max_batch_size`` x ``max_seq_len`` and the context-phase buffers,
  plus a fixed runtime overhead (CUDA context, cuBLAS workspace, NCCL buffers).
* :func:`check_index_range`: a full batch (``max_batch_size`` rows of ``n_positions`` tokens)
  within the 32-bit integers FT's kernels index their buffers with (:func:`index_limits`), which
  no amount of GPU memory lifts.

The estimate follows FT's GPT-J allocation (``GptJWeight``, ``ParallelGpt`` buffers): weights
per rank = layers of its pipeline stage split T ways + the embedding, final norm and lm_head
(vocabulary padded to a multiple of 8 per rank) on every GPU; KV cache = 2 x layers/P x batch x
seq x hidden/T elements. It is an estimate for capacity planning, not a guarantee: keep
headroom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loader.errors import CheckpointError, ParallelismError, PlacementError
from loader.formats.fastertransformer import FTConfig, UnsupportedHeadSizeError, check_head_size
from loader.parallel import Parallelism

GIB = 2**30
#: Per-GPU memory the runtime takes besides weights and buffers (CUDA context, cuBLAS
#: workspace, NCCL buffers). An estimate measured to be between 0.5 and 1 GiB on A100s.
RUNTIME_OVERHEAD_BYTES = 1 * GIB
#: The most memory one GPU of any node type has (NVIDIA B200: 192 GB = 178.8 GiB, rounded up):
#: a configuration whose estimate exceeds it fits no node, whatever ``--gpu-memory-gib`` says.
LARGEST_GPU_MEMORY_GIB = 180.0
#: A plan with less free memory than this share of the GPU is reported as tight.
TIGHT_HEADROOM_SHARE = 0.10

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a GPT-J/CodeGen model that size its memory."""

    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int
    n_inner: int
    n_positions: int

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelShape:
        """From a Hugging Face ``config.json`` (GPT-J / CodeGen keys)."""

        def pick(*names: str) -> int | None:
            for name in names:
                value = config.get(name)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise CheckpointError(
                        f"config.json {name} must be a positive whole number, got {value!r}.",
                        "Use the checkpoint's original config.json.",
                    )
                return value
            return None

        values = {
            "n_embd": pick("n_embd", "hidden_size"),
            "n_layer": pick("n_layer", "num_hidden_layers"),
            "n_head": pick("n_head", "num_attention_heads"),
            "vocab_size": pick("vocab_size"),
            "n_positions": pick("n_positions", "max_position_embeddings", "n_ctx"),
        }
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise CheckpointError(
                f"config.json lacks {', '.join(missing)}, needed to size the model.",
                "Use a complete GPT-J/CodeGen config.json, or pass the model's numbers to "
                "`model-loader plan` explicitly.",
            )
        n_inner = pick("n_inner") or 4 * values["n_embd"]
        return cls(n_inner=n_inner, **values)  # type: ignore[arg-type]

    @classmethod
    def from_ft_config(cls, config: FTConfig) -> ModelShape:
        """From the hyper-parameters a conversion writes (``config.ini``)."""
        return cls(
            n_embd=config.hidden_size,
            n_layer=config.num_layer,
            n_head=config.head_num,
            vocab_size=config.vocab_size,
            n_inner=config.inter_size,
            n_positions=config.max_pos_seq_len,
        )

    @property
    def size_per_head(self) -> int:
        return self.n_embd // self.n_head

    def parameters(self) -> int:
        """Parameters of the whole model (as the Hugging Face checkpoint holds them)."""
        h, inner, v = self.n_embd, self.n_inner, self.vocab_size
        layer = 2 * h + 4 * h * h + 2 * h * inner + inner + h
        return self.n_layer * layer + 2 * v * h + v + 2 * h


#: Shapes of models we serve, for planning without a checkpoint at hand (the published CodeGen
#: configurations and GPT-J-6B).
MODEL_PRESETS: dict[str, ModelShape] = {
    "codegen-350m": ModelShape(1024, 20, 16, 51200, 4096, 2048),
    "codegen-2b": ModelShape(2560, 32, 32, 51200, 10240, 2048),
    "codegen-6b": ModelShape(4096, 33, 16, 51200, 16384, 2048),
    "codegen-16b": ModelShape(6144, 34, 24, 51200, 24576, 2048),
    "gpt-j-6b": ModelShape(4096, 28, 16, 50400, 16384, 2048),
}


@dataclass(frozen=True)
class Topology:
    """Where replicas run: GPUs each replica sees, replicas per node, GPUs per node."""

    gpus_per_replica: int
    replicas_per_node: int = 1
    gpus_per_node: int | None = None


def check_placement(
    parallelism: Parallelism,
    topology: Topology,
    *,
    n_layer: int | None = None,
) -> None:
    """Raise :class:`PlacementError` naming the number to change if FT cannot place this."""
    tp, pp, count = parallelism.tp, parallelism.pp, parallelism.instance_count
    group = parallelism.gpus_per_instance
    gpus = topology.gpus_per_replica
    if gpus < 1:
        raise PlacementError(
            f"--gpus-per-replica must be at least 1, got {gpus}.",
            f"Pass --gpus-per-replica {group} (tensor-parallel x pipeline-parallel size).",
        )
    if gpus % group:
        raise PlacementError(
            f"A replica sees {gpus} GPUs, not a multiple of tensor-parallel x pipeline-parallel "
            f"= {tp} x {pp} = {group}; FasterTransformer needs whole GPU groups.",
            f"Change --gpus-per-replica to a multiple of {group} (e.g. {group}), "
            "or change --tp-size/--pp-size.",
        )
    if group * count < gpus:
        needed = gpus // group
        raise PlacementError(
            f"{count} instance(s) of {group} GPU(s) cover {group * count} of the {gpus} GPUs a "
            "replica sees; FasterTransformer needs every visible GPU used.",
            f"Raise --instance-count to {needed}, or lower --gpus-per-replica to {group * count}.",
        )
    if n_layer is not None:
        parallelism.check_layers(n_layer)
    node = topology.gpus_per_node
    if node is not None:
        if topology.replicas_per_node < 1:
            raise PlacementError(
                f"--replicas-per-node must be at least 1, got {topology.replicas_per_node}.",
                "Pass --replicas-per-node 1 or more.",
            )
        if topology.replicas_per_node * gpus > node:
            fit = node // gpus
            raise PlacementError(
                f"{topology.replicas_per_node} replica(s) x {gpus} GPUs need "
                f"{topology.replicas_per_node * gpus} GPUs, but a node has {node}.",
                f"Lower --replicas-per-node to {fit} or lower --tp-size."
                if fit
                else f"One replica needs more GPUs ({gpus}) than a node has: lower --tp-size "
                "(or --pp-size), or use nodes with more GPUs.",
            )


def _padded_vocab(vocab: int, tp: int) -> int:
    local = math.ceil(vocab / tp)
    return math.ceil(local / 8) * 8 * tp


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of one replica (the busiest GPU)."""

    weights: int
    working_per_instance: int
    instances_per_gpu: int
    overhead: int

    @property
    def working(self) -> int:
        return self.working_per_instance * self.instances_per_gpu

    @property
    def total(self) -> int:
        return self.weights + self.working + self.overhead


def estimate_memory(
    shape: ModelShape,
    parallelism: Parallelism,
    *,
    dtype: str,
    max_batch_size: int,
    gpus_per_replica: int | None = None,
    max_seq_len: int | None = None,
) -> MemoryEstimate:
    """Weights and working memory per GPU for FT GPT-J (see the module docstring)."""
    if dtype not in DTYPE_BYTES:
        raise PlacementError(
            f"Cannot size weights of dtype {dtype!r}.",
            f"Use one of: {', '.join(DTYPE_BYTES)}.",
        )
    size = DTYPE_BYTES[dtype]
    tp, pp = parallelism.tp, parallelism.pp
    h, inner, heads = shape.n_embd, shape.n_inner, shape.n_head
    layers = math.ceil(shape.n_layer / pp)
    vocab = _padded_vocab(shape.vocab_size, tp)
    per_layer = 2 * h + (4 * h * h + 2 * h * inner + inner) // tp + h
    weights = (layers * per_layer + 2 * vocab * h + vocab + 2 * h) * size

    batch = max_batch_size
    seq = max_seq_len or shape.n_positions
    kv_cache = 2 * layers * batch * seq * (h // tp) * size
    # Context phase: hidden states in/out, fused QKV, FFN intermediate, attention scores.
    context = batch * seq * (2 * h + 3 * h // tp + inner // tp) * size
    scores = batch * math.ceil(heads / tp) * seq * seq * size
    logits = 2 * batch * vocab * 4  # fp32 logits and their softmax
    working = kv_cache + context + scores + logits

    gpus = gpus_per_replica or parallelism.gpus_per_instance
    per_gpu = math.ceil(parallelism.instance_count * parallelism.gpus_per_instance / gpus)
    return MemoryEstimate(weights, working, per_gpu, RUNTIME_OVERHEAD_BYTES)


#: The largest index a C ``int`` (signed) and ``unsigned int`` hold.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


def index_limits(
    shape: ModelShape, parallelism: Parallelism, *, max_seq_len: int | None = None
) -> list[tuple[str, int, int, bool]]:
    """What one row of a full batch adds to each buffer FasterTransformer indexes with a 32-bit
    integer: ``(what, elements per row, the integer's limit, whether T splits it)``. Rows are
    ``max_seq_len`` (default ``n_positions``) tokens long, the most ``preprocessing`` lets a
    request have."""
    tp, seq, h = parallelism.tp, max_seq_len or shape.n_positions, shape.n_embd
    return [
        # kernels/unfused_attention_kernels.cu, add_fusedQKV_bias_transpose_kernel (the rotary
        # variant GPT-J's context attention runs): `token_idx * 3 * n` in int. The KV cache of
        # one layer, B x S x h/T, indexed in int by the generation kernel
        # (decoder_masked_multihead_attention_template.hpp, `bhi * memory_max_len * Dh`), and
        # the pipeline hand-over (GptJContextDecoder.cc, `int data_size`) are smaller.
        ("fused QKV activations (tokens x 3 x hidden / T)", seq * 3 * h // tp, INT32_MAX, True),
        # kernels/activation_kernels.cu, invokeAddBiasGeluV2 / generic_activation: `m * n` in int.
        ("MLP activations (tokens x n_inner / T)", seq * shape.n_inner // tp, INT32_MAX, True),
        # kernels/gpt_kernels.cu, buildDecoderAttentionMaskKernel: `blockIdx.x *
        # mask_size_per_seq`, an unsigned int.
        ("context attention mask (rows x tokens x tokens)", seq * seq, UINT32_MAX, False),
        # kernels/sampling_topk_kernels.cu, topk_stage1 (`batch_id * vocab_size`) and
        # invokeTopKSampling (`batch_size * vocab_size`), in int, over the gathered logits.
        (
            "logits (rows x padded vocabulary)",
            _padded_vocab(shape.vocab_size, tp),
            INT32_MAX,
            False,
        ),
    ]


def max_batch_for_indices(
    shape: ModelShape, parallelism: Parallelism, *, max_seq_len: int | None = None
) -> int:
    """The largest ``max_batch_size`` whose full batch stays within :func:`index_limits`."""
    limits = index_limits(shape, parallelism, max_seq_len=max_seq_len)
    return min(limit // per_row for _, per_row, limit, _ in limits)


def check_index_range(
    shape: ModelShape,
    parallelism: Parallelism,
    *,
    max_batch_size: int,
    max_seq_len: int | None = None,
) -> None:
    """Raise :class:`PlacementError` when a full batch (``max_batch_size`` rows of the longest
    sequence) would index one of FasterTransformer's buffers past the 32-bit integer its kernel
    computes the index in: the index wraps and the kernel reads and writes the wrong elements
    (garbage, or an illegal address), whatever the GPU memory."""
    seq = max_seq_len or shape.n_positions
    for what, per_row, limit, split in index_limits(shape, parallelism, max_seq_len=max_seq_len):
        if max_batch_size * per_row <= limit:
            continue
        most = max_batch_for_indices(shape, parallelism, max_seq_len=max_seq_len)
        if most >= 1:
            fix = f"Lower --max-batch-size to at most {most}" + (
                " or raise --tp-size." if split else "."
            )
        else:
            fix = f"Serve the model with a shorter context than {seq} tokens (n_positions)."
        raise PlacementError(
            f"A full batch of {max_batch_size} rows of {seq} tokens gives FasterTransformer "
            f"{max_batch_size * per_row} elements of {what} per GPU, beyond the 32-bit index "
            f"({limit}) its kernel computes; it would read and write the wrong elements.",
            fix,
        )


def check_memory(estimate: MemoryEstimate, gpu_memory_gib: float | None) -> None:
    """Raise :class:`PlacementError` if the estimate exceeds the GPU's memory; with no GPU
    memory given, if it exceeds :data:`LARGEST_GPU_MEMORY_GIB` (no node could serve it: an
    instance count or batch size that large is a typo)."""
    given = gpu_memory_gib is not None
    capacity_gib = gpu_memory_gib if gpu_memory_gib is not None else LARGEST_GPU_MEMORY_GIB
    if estimate.total <= capacity_gib * GIB:
        return
    where = (
        f"its {capacity_gib:g} GiB"
        if given
        else f"the {capacity_gib:g} GiB of the largest GPU any node has"
    )
    raise PlacementError(
        f"Each GPU needs about {estimate.total / GIB:.1f} GiB (weights "
        f"{estimate.weights / GIB:.1f} GiB + {estimate.instances_per_gpu} instance(s) x "
        f"{estimate.working_per_instance / GIB:.1f} GiB working memory + "
        f"{estimate.overhead / GIB:.1f} GiB runtime), more than {where}.",
        "Raise --tp-size (fewer weights per GPU), lower --max-batch-size or --instance-count "
        "(less working memory), or use GPUs with more memory; `model-loader plan` shows options.",
    )


@dataclass(frozen=True)
class PlanRow:
    """One candidate configuration and its verdict."""

    parallelism: Parallelism
    topology: Topology
    estimate: MemoryEstimate | None
    gpu_memory_gib: float | None
    verdict: str
    problem: str = ""

    @property
    def headroom_bytes(self) -> int | None:
        if self.estimate is None or self.gpu_memory_gib is None:
            return None
        return int(self.gpu_memory_gib * GIB) - self.estimate.total


def plan_row(
    shape: ModelShape,
    parallelism: Parallelism,
    topology: Topology,
    *,
    dtype: str,
    max_batch_size: int,
    gpu_memory_gib: float | None,
    max_seq_len: int | None = None,
) -> PlanRow:
    """Evaluate one configuration: the head size and placement rules first, then memory."""
    try:
        check_head_size(shape.size_per_head, where="the model")
        check_placement(parallelism, topology, n_layer=shape.n_layer)
        parallelism.split(shape.n_head, "the attention head count")
        parallelism.split(shape.n_inner, "the MLP width (n_inner)")
        check_index_range(
            shape, parallelism, max_batch_size=max_batch_size, max_seq_len=max_seq_len
        )
    except (ParallelismError, UnsupportedHeadSizeError) as exc:
        problem = f"{exc.message} {exc.remediation}"
        return PlanRow(parallelism, topology, None, gpu_memory_gib, "invalid", problem)
    estimate = estimate_memory(
        shape,
        parallelism,
        dtype=dtype,
        max_batch_size=max_batch_size,
        gpus_per_replica=topology.gpus_per_replica,
        max_seq_len=max_seq_len,
    )
    if gpu_memory_gib is None:
        return PlanRow(parallelism, topology, estimate, None, "unchecked")
    headroom = gpu_memory_gib * GIB - estimate.total
    if headroom < 0:
        verdict = "does not fit"
    elif headroom < TIGHT_HEADROOM_SHARE * gpu_memory_gib * GIB:
        verdict = "tight"
    else:
        verdict = "fits"
    return PlanRow(parallelism, topology, estimate, gpu_memory_gib, verdict)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def format_table(rows: list[PlanRow]) -> str:
    """An aligned text table of plan rows (one line per candidate)."""
    header = (
        "TP",
        "PP",
        "INST",
        "GPUS/REPLICA",
        "REPLICAS/NODE",
        "WEIGHTS/GPU GiB",
        "WORKING/GPU GiB",
        "RUNTIME/GPU GiB",
        "TOTAL/GPU GiB",
        "GPU GiB",
        "HEADROOM GiB",
        "VERDICT",
    )
    lines = [header]
    for row in rows:
        est = row.estimate
        verdict = row.verdict + (f": {row.problem}" if row.problem else "")
        lines.append(
            (
                str(row.parallelism.tp),
                str(row.parallelism.pp),
                str(row.parallelism.instance_count),
                str(row.topology.gpus_per_replica),
                str(row.topology.replicas_per_node),
                _gib(est.weights if est else None),
                _gib(est.working if est else None),
                _gib(est.overhead if est else None),
                _gib(est.total if est else None),
                "-" if row.gpu_memory_gib is None else f"{row.gpu_memory_gib:g}",
                _gib(row.headroom_bytes),
                verdict,
            )
        )
    # Five lines of str.rjust: tabulate pads headers to a width of its own (MIN_PADDING) and
    # would be a new dependency of the core install for the same table.
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for line in lines:
        cells = [cell.rjust(width) for cell, width in zip(line[:-1], widths, strict=True)]
        out.append("  ".join([*cells, line[-1]]).rstrip())
    return "\n".join(out)
