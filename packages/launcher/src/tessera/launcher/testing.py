"""The serial oracle: a model trained in one process with plain PyTorch, against which the
same model trained through ``boost()`` is held, rank by rank.

The serial run is the definition of correct: forward, mean cross-entropy over every token,
backward, one optimizer step, on the whole batch. A composition of dp, pp, tp, cp and ZeRO
must reproduce its losses and, once every rank's shards are merged, its weights, up to the
round-off of summing in another order. A test file keeps its model builder and one
module-level worker (the pool resolves it by file path)::

    TOKENS = RandomTokens(vocab=64, batch=8, seq=16)

    def _parallel(rank: int, config: Config) -> Run:
        return boosted_run(build(), TOKENS.first(3), config, sgd(0.5))

    def test_follows_the_serial_run(worker_pools: PoolFactory) -> None:
        config = oracle_config(ParallelConfig(tp=2), batch_size=8)
        results = worker_pools(config.world_size).run(_parallel, config)
        assert_matches_serial(results, serial_run(build(), TOKENS.first(3), sgd(0.5)))

Nothing here imports pytest: mismatches are reported by ``torch.testing.assert_close`` (its
own report of how far apart the values are) and by assertions that name the rank and step.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.launcher.config import Config, ParallelConfig, TrainConfig, ZeroConfig
from tessera.launcher.train.boost import boost
from tessera.moe import balance_choice_biases, set_aux_grad_scale
from tessera.zero import Precision

if TYPE_CHECKING:
    from tessera.comm.testing.pool import WorkerPool

__all__ = [
    "CHAT_TEMPLATE",
    "Batch",
    "OptimizerFactory",
    "RandomTokens",
    "Run",
    "assert_losses_close",
    "assert_matches_serial",
    "boosted_run",
    "logits_of",
    "oracle_config",
    "redrawn",
    "serial_run",
    "sgd",
    "tiny_pretrained",
    "tiny_tokenizer",
]

Batch = tuple[Tensor, Tensor]
"""Token ids and their targets, both (batch, seq)."""

Run = tuple[list[float], dict[str, Tensor]]
"""The loss of every step and the trained weights by serial parameter name (on a pipeline
rank: its stages' only)."""

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
"""Builds the optimizer over a freshly built model (the serial one, or a rank's before boost)."""


@dataclass(frozen=True, slots=True)
class RandomTokens:
    """Batches of ``batch`` rows of ``seq`` uniform random token ids below ``vocab``, each with
    its next-token targets; step ``k``'s batch comes from a generator seeded with ``k`` (the
    global random state is not touched), so every process draws the same batches."""

    vocab: int
    batch: int
    seq: int

    def at(self, step: int) -> Batch:
        """The batch of ``step``: ids ``tokens[:, :-1]`` and targets ``tokens[:, 1:]``."""
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def first(self, steps: int) -> list[Batch]:
        """The batches of steps ``0 .. steps - 1``."""
        return [self.at(step) for step in range(steps)]


def sgd(lr: float, momentum: float = 0.9) -> OptimizerFactory:
    """SGD with momentum over every parameter: the oracle's optimizer (linear in the gradient,
    so round-off in a gradient stays round-off in the weights)."""

    def make(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

    return make


def logits_of(output: object) -> Tensor:
    """A model's logits: its output itself, or a Hugging Face output's ``.logits``."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if not isinstance(logits, Tensor):
        raise TypeError(f"a model output of type {type(output).__name__} is no Tensor and has no .logits")
    return logits


def serial_run(
    model: nn.Module,
    batches: Iterable[Batch],
    optimizer: OptimizerFactory,
    *,
    chunks: int = 1,
    loss: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Run:
    """Train ``model`` in this process, one step per batch: the mean cross-entropy of its logits
    over every token (or ``loss(logits, targets)``), backward, ``optimizer`` step (no clipping,
    nothing else). ``chunks``: each batch trains as that many equal row chunks, each chunk's
    loss divided by ``chunks``, as a boosted run over dp x microbatches chunks trains it (what
    a loss that is no mean over tokens needs: an MoE's load-balancing loss is per call); the
    router losses that ``tessera.moe.MoE`` layers train on from inside then weigh ``1 / chunks``
    per call, as the engine weighs them. After each step the choice biases of MoE layers with a
    ``bias_rate`` move by the step's load (`tessera.moe.balance_choice_biases`), as the engine's."""
    opt = optimizer(model)
    objective = loss if loss is not None else _cross_entropy
    if chunks > 1:
        set_aux_grad_scale(model, 1 / chunks)
    losses = []
    for ids, targets in batches:
        opt.zero_grad()
        total = 0.0
        for x, y in zip(ids.chunk(chunks), targets.chunk(chunks), strict=True):
            value = objective(logits_of(model(x)), y)
            (value / chunks).backward()  # type: ignore[no-untyped-call]
            total += value.item() / chunks
        opt.step()
        balance_choice_biases(model)  # MoE routers balanced by a bias (bias_rate): after the step
        losses.append(total)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def oracle_config(
    parallel: ParallelConfig, zero: int | ZeroConfig = 0, *, batch_size: int, **train: Any
) -> Config:
    """A configuration whose boosted run is comparable with `serial_run`: ``parallel``, ZeRO
    stage ``zero`` (or a whole `ZeroConfig`), fp32, a global batch of ``batch_size`` rows and
    no gradient clipping; ``train``: further `TrainConfig` fields (``compile=True``, ...)."""
    stage = zero if isinstance(zero, ZeroConfig) else ZeroConfig(stage=zero)
    base = Config(parallel=parallel, zero=stage, train=TrainConfig(precision=Precision.FP32, **train))
    return dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, batch_size=batch_size),
        optim=dataclasses.replace(base.optim, clip_grad_norm=0.0),  # the serial run does not clip
    )


def boosted_run(
    model: nn.Module,
    batches: Iterable[Batch],
    config: Config,
    optimizer: OptimizerFactory,
    **boost_kwargs: Any,
) -> Run:
    """On each rank (collective): ``boost(model, optimizer(model), config, **boost_kwargs)``,
    one ``train_step`` per batch, then this rank's full weights (``Engine.full_state_dict``).
    The engine's mesh is closed at the end, also on an error (its process groups do not
    outlive the run in a long-lived worker); the rest of the engine (a chunk manager's disk
    files) is left as it is, for the caller to inspect."""
    engine = boost(model, optimizer(model), config, **boost_kwargs)
    try:
        losses = [engine.train_step(ids, targets).loss for ids, targets in batches]
        weights = engine.full_state_dict()
    finally:
        engine.mesh.close()
    return losses, weights


def redrawn(model: nn.Module, seed: int) -> nn.Module:
    """``model`` with every parameter drawn anew from ``seed`` (normal, std 0.3) in name order,
    and every router score-correction bias (``e_score_correction_bias``, std 0.1): Hugging Face
    leaves routers and those biases at zero, where every expert ties. Returns it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def assert_losses_close(
    curves: Iterable[Sequence[float]], want: Sequence[float], *, rel: float = 1e-5
) -> None:
    """Every rank's loss curve equals ``want`` step by step within ``rel`` of the wanted loss
    (as ``pytest.approx(want, rel=rel)``: also within 1e-12 absolute)."""
    for rank, curve in enumerate(curves):
        assert len(curve) == len(want), f"rank {rank}: {len(curve)} losses, the serial run has {len(want)}"
        far = []
        for step, (got, expected) in enumerate(zip(curve, want, strict=True)):
            if not (got == expected or abs(got - expected) <= max(rel * abs(expected), 1e-12)):
                off = abs(got - expected) / abs(expected or 1.0)
                far.append(f"step {step}: {got!r} against {expected!r} (rel {off:.2e})")
        assert not far, f"rank {rank}: losses beyond rel {rel} of the serial run's: " + "; ".join(far)


def assert_matches_serial(
    results: Iterable[Run], serial: Run, *, rel: float = 1e-5, rtol: float = 1e-5, atol: float = 1e-6
) -> dict[str, Tensor]:
    """Every rank's losses against the serial run's (``rel``), then each rank's weights and the
    weights of all ranks merged (each pipeline rank holds its stages') against the serial weights, elementwise
    (``atol + rtol * |serial|``, every name present on both sides); returns the merged weights.

    The default bounds are for a few SGD steps in fp32 (the tests take 3). A loss is a mean over the
    batch's token losses, which tp, dp, cp and microbatches sum in another order: a few ulps,
    well inside rel 1e-5. SGD with momentum is linear in the gradient, so the weights stay at
    round-off (measured at most ~1e-7): atol 1e-6 + rtol 1e-5. Under AdamW, whose update
    divides by the root of the second moment and so amplifies round-off in near-zero
    gradients, a caller passes its own wider bound and says why. A wrong shard, a lost
    gradient contribution or a block run out of order is off by the size of an update.
    """
    runs = list(results)
    assert_losses_close((curve for curve, _ in runs), serial[0], rel=rel)
    merged: dict[str, Tensor] = {}
    for rank, (_, weights) in enumerate(runs):  # each rank's own, then all of them together
        missing = sorted(set(weights) - set(serial[1]))
        assert not missing, f"rank {rank} holds weights the serial model lacks: {missing[:8]}"
        torch.testing.assert_close(weights, {n: serial[1][n] for n in weights}, rtol=rtol, atol=atol)
        merged.update(weights)
    torch.testing.assert_close(merged, serial[1], rtol=rtol, atol=atol)
    return merged


def weights_distance(got: Run, want: Run) -> float:
    """The largest difference of a weight of ``got`` from ``want``'s, relative to the largest
    value of ``want``'s tensor (each name of ``want``; KeyError naming one ``got`` lacks)."""
    return max(
        float((got[1][n].to(w.dtype) - w).abs().max()) / max(float(w.abs().max()), 1e-6)
        for n, w in want[1].items()
    )


def survey_verdict(got: Run, want: Run, sensitivity: float = 0.0) -> str:
    """A survey's one-word comparison of a parallel run with the serial one: ``ok`` when the
    losses agree to rel 1e-5 and the weights to rel 1e-4 of each tensor's largest value, or to
    10 times ``sensitivity`` where that is larger (how far the serial fp32 run is from the same
    run in fp64, `weights_distance`: a model whose steps amplify fp32 round-off that much
    differs by as much from any reordering of its sums), else ``WRONG`` with the figures.
    Surveys train a few large SGD steps, where round-off grows past `assert_matches_serial`'s
    bounds in some families; the tests hold their cases to those."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0], strict=True))
    weight = weights_distance(got, want)
    if loss < 1e-5 and weight < max(1e-4, 10 * sensitivity):
        return "ok"
    return f"WRONG loss rel {loss:.1e}, weights rel {weight:.1e} (fp32 round-off alone {sensitivity:.1e})"


def fp64_distance(
    want: Run, build: Callable[[], nn.Module], batches: Iterable[Batch], optimizer: OptimizerFactory
) -> float:
    """A survey's sensitivity: `weights_distance` of the serial fp32 run ``want`` from the same
    `serial_run` of ``build()`` cast to float64; 0.0 where that raises a ``RuntimeError`` (a model
    that does not run in fp64: transformers' grouped experts take no float64)."""
    try:
        exact = serial_run(build().double(), batches, optimizer)
    except RuntimeError:
        return 0.0
    return weights_distance(want, exact)


def survey_row(
    pool: WorkerPool,
    fn: Callable[[int, str, Config], Run],
    kind: str,
    modes: Mapping[str, tuple[ParallelConfig, int]],
    want: Run,
    sensitivity: float,
    *,
    batch_size: int,
    timeout: float,
    rename: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
) -> dict[str, str]:
    """A survey's row for family ``kind``: for each mode (its degrees and ZeRO stage), every
    rank of ``pool`` runs ``fn(rank, kind, oracle_config(degrees, zero, batch_size=batch_size))``
    within ``timeout`` seconds, the ranks' weights are merged (then passed through ``rename``,
    where given) and `survey_verdict` holds them and rank 0's losses to ``want``. A mode that
    raises reads ``refused: <first line>``; a pool whose ranks timed out or died is closed (its
    next call starts it anew)."""
    row: dict[str, str] = {}
    for mode, (degrees, zero) in modes.items():
        try:
            config = oracle_config(degrees, zero, batch_size=batch_size)
            parts = pool.run(fn, kind, config, timeout=timeout)
            merged: dict[str, Tensor] = {}
            for _, part in parts:
                merged.update(part)
            if rename is not None:
                merged = rename(merged)
            row[mode] = survey_verdict((parts[0][0], merged), want, sensitivity)
        except Exception as exc:
            row[mode] = "refused: " + str(exc).split("\n")[0][:160]
            if "did not finish" in str(exc) or "died" in str(exc):
                pool.close()
    return row


_SPECIALS = ["<pad>", "<eos>", "<bos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "User: what is two plus two? Assistant: four",
    "Assistant: hello there, café naïve",
] * 3
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The chat template `tiny_tokenizer` carries (each message between its role's marker and <|end|>)."""


def tiny_tokenizer(*, bos: bool = False, template: str = CHAT_TEMPLATE) -> Any:
    """A ``transformers`` tokenizer made here, nothing downloaded: a byte-level BPE of 400 ids
    trained on a few sentences, with pad, eos, bos and chat-marker special tokens and a chat
    ``template``; ``bos``: it puts <bos> before every text it encodes. Needs the ``tokenizers``
    and ``transformers`` packages."""
    tokenizers: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=_SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    if bos:
        bos_id = _SPECIALS.index("<bos>")
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", bos_id)]
        )
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        bos_token="<bos>",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = template
    return wrapped


def tiny_pretrained(folder: str | Path, *, hidden: int = 32, layers: int = 2) -> Path:
    """A "pretrained" Hugging Face Llama written to ``folder`` as ``save_pretrained`` writes one
    (random weights from seed 0, 4 query and 2 KV heads, `tiny_tokenizer`'s vocabulary and its
    files beside): a stand-in for a download. Needs ``transformers``; returns the folder."""
    transformers: Any = importlib.import_module("transformers")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
