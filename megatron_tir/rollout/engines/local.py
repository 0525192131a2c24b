"""In-process generation engine: a HuggingFace causal LM in torch with continuous batching.

The embedded default (CPU) and the tests use it; it implements the same
:class:`~megatron_tir.rollout.engines.base.GenerationEngine` interface as the SGLang
client, so the rollout driver cannot tell them apart.

How it works
    * ``generate`` puts the request in a FIFO queue and awaits a future.
    * One background asyncio task (the scheduler) runs the model one *step* at a time in a
      single worker thread, so the event loop stays free for sandbox I/O. A step either
      prefills the newly admitted requests (left-padded, attention mask + per-row
      position ids) and samples their first token, or decodes one token for every
      running request. New requests join the running batch at the next step
      (continuous batching); finished rows leave it. How the KV cache is held is the
      decoder's (:mod:`megatron_tir.rollout.engines.decoders`, ``LocalEngineConfig.decoder``):
      preallocated per-row slots written in place (Llama / Qwen2 / Mistral layouts), or
      the HF forward over a left-padded ``DynamicCache`` (any other architecture).
    * Prefix cache (slot decoder only, ``LocalEngineConfig.prefix_cache_tokens``, SGLang's
      radix cache in miniature): when a request finishes, its K/V is kept in an LRU
      (:mod:`megatron_tir.rollout.engines.prefix_cache`); a later request whose context
      starts with a kept one -- the next turn of a TIR trajectory is the previous turn's
      context + its output + the tool's feedback -- copies that K/V into its slot and
      prefills only the rest. Requests admitted in the same step share a common prefix
      (a group's prompts) the same way. Entries written under older weights are never
      kept, and a weight update empties the cache. Reused K/V equals what a fresh prefill
      would compute up to float rounding (the ~1e-5 above).
    * Sampling, and which log-prob is returned, is documented in
      :mod:`megatron_tir.rollout.engines.sampling`: ``log_softmax(logits / T)`` of the
      sampled token, before top-k / top-p truncation. Each request owns a
      ``torch.Generator`` (seeded from ``SamplingParams.seed``, or from the engine's seed
      when ``None``), so a request's output does not depend on what else is in the
      batch -- up to float rounding: batched and unbatched matmuls differ in the last
      bits, so log-probs agree to ~1e-5 (float32), and Gumbel-max sampling changes a
      token only when the two best perturbed scores are that close (~1e-6 per token).
    * Finish: a stop string completed in the *generated* text (the completing token is
      kept, SGLang ``no_stop_trim``), an EOS id (kept), ``max_new_tokens``, the model's
      context limit (LENGTH, ``meta["context_limit"] = True``), or ABORT (``pause`` in
      ``PauseMode.ABORT``, ``close``).
    * ``update_weights`` and ``pause`` take effect between two steps (the weight sync,
      :class:`~megatron_tir.rollout.sync.local.LocalWeightSync`, is their one caller). Requests in flight
      during a weight update continue under the new weights: with their KV cache (like
      SGLang's ``in_place`` pause, or no pause), or with it recomputed on resume
      (``PauseMode.RETRACT``: the request is prefilled again over prompt + generated ids).
      ``Generation.versions`` says which weight version sampled each output token;
      ``Generation.meta`` carries the versions at the request's start and finish, and
      ``weight_versions`` as spans (``[{"version", "start", "end"}]``, SGLang's
      ``meta_info.weight_versions``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_tir.rollout.engines.openmp import release_idle_threads
from megatron_tir.rollout.engines.base import (DEFAULT_PAUSE_MODE, ContextTooLong, FinishReason, Generation, PauseMode,
                                               SamplingParams, bind_event_loop, check_generate_args, check_release,
                                               check_resume, pause_mode)
from megatron_tir.rollout.engines.decoders import HFDecoder, SlotDecoder, supports_slot_decoder
from megatron_tir.rollout.engines.hf_names import file_named_tensors
from megatron_tir.rollout.engines.eos import DEFAULT_EXTRA_EOS_TOKENS, resolve_eos_token_ids
from megatron_tir.rollout.engines.prefix_cache import PrefixCache, common_prefix
from megatron_tir.rollout.engines.sampling import sample_tokens
from megatron_tir.rollout.engines.stop import StopStringMatcher

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ATTN = ("sdpa", "eager")
_DECODERS = ("auto", "slot", "hf")


@dataclass(kw_only=True, slots=True)
class LocalEngineConfig:
    """How to build a :class:`LocalEngine`."""

    model: str = "smollm2"  # "smollm2" or an HF model directory (see megatron_tir.model_sources.resolve_model)
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    max_batch_size: int = 8  # requests decoded together
    max_seq_len: int | None = None  # prompt + generated; None: the model's max_position_embeddings
    torch_threads: int | None = None  # torch.set_num_threads (process-wide); None: leave as is
    seed: int = 0  # seeds the per-request generators of requests without SamplingParams.seed
    eos_token_ids: tuple[int, ...] | None = None  # None: generation_config + config + tokenizer + extra_eos_tokens
    extra_eos_tokens: tuple[str, ...] = DEFAULT_EXTRA_EOS_TOKENS  # also end a sequence, when in the vocabulary
    attn_implementation: str = "sdpa"  # sdpa | eager
    decoder: str = "auto"  # slot | hf | auto (slot where the architecture allows); see engines.decoders
    # hand idle OpenMP threads back: the building thread's after loading, the worker's whenever the
    # engine runs dry (megatron_tir.rollout.engines.openmp: two idle teams make every parallel region sleep on 2 cores)
    release_idle_threads: bool = True
    # slot decoder with max_batch_size > 2, on CPU in float32: its products run over weights reordered
    # once into oneDNN's blocked layout (~0.54 GB for SmolLM2-135M, instead of the ~0.43 GB of
    # transposed copies it uses otherwise); 1.45x the tokens/s at 16 rows (docs/benchmarks.md, Local engine)
    pack_weights: bool = True
    # slot decoder: K/V of finished requests kept (least recently used out) within this many tokens and
    # reused by requests that start with the same tokens, like SGLang's radix cache (engines.prefix_cache;
    # a multi-turn rollout's next turn, its siblings' shared prompt); cleared at every weight update.
    # 0: off. SmolLM2-135M in float32: 46 KB a token (8192 tokens: 0.38 GB)
    prefix_cache_tokens: int = 8192

    def __post_init__(self) -> None:
        if not str(self.model):
            raise ValueError("model must be 'smollm2' or an HF model directory")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not isinstance(self.prefix_cache_tokens, int) or isinstance(self.prefix_cache_tokens, bool) \
                or self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be an integer >= 0, got {self.prefix_cache_tokens!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.eos_token_ids is not None and any(int(t) < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative, got {self.eos_token_ids}")
        if self.attn_implementation not in _ATTN:
            raise ValueError(f"attn_implementation must be one of {_ATTN}, got {self.attn_implementation!r}")
        for name in ("release_idle_threads", "pack_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.decoder not in _DECODERS:
            raise ValueError(f"decoder must be one of {_DECODERS}, got {self.decoder!r}")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")


@dataclass(slots=True, eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    rng: torch.Generator
    stop: StopStringMatcher
    weight_version_start: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_spans: list[dict] = field(default_factory=list)  # {"version", "start", "end"} over token_ids
    finish: FinishReason | None = None
    matched_stop: str | None = None
    context_limit: bool = False
    kv_version: int = -1  # the weight version its K/V were prefilled under


@dataclass(slots=True)
class _Batch:
    """The running requests and their KV cache (worker-thread state)."""

    requests: list[_Request] = field(default_factory=list)
    cache: object | None = None  # the decoder's state over the cached tokens (engines.decoders)
    pending_B: torch.Tensor | None = None  # last sampled token of each row, not yet in the cache


class LocalEngine:
    """Continuous-batching torch engine over an HF causal LM (see the module docstring).

    ``LocalEngine(LocalEngineConfig(model="smollm2"))``; use it from one event loop.
    """

    def __init__(self, config: LocalEngineConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from megatron_tir.model_sources import resolve_model

        self.config = config
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.model_dir: Path = resolve_model(config.model)
        self.device = torch.device(config.device)
        log.info("loading %s on %s (%s)", self.model_dir, self.device, config.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=_DTYPES[config.dtype], attn_implementation=config.attn_implementation
        )
        self.model = model.to(self.device).eval().requires_grad_(False)
        self._check_full_attention()
        self._decoder = self._make_decoder()
        self.prefix_cache = (PrefixCache(config.prefix_cache_tokens)
                             if config.prefix_cache_tokens and isinstance(self._decoder, SlotDecoder) else None)
        self.vocab_size: int = self.model.get_input_embeddings().weight.shape[0]
        self.max_seq_len: int = config.max_seq_len or int(
            getattr(self.model.config, "max_position_embeddings", 0) or 4096
        )
        self.eos_token_ids: tuple[int, ...] = self._resolve_eos()
        self._eos = frozenset(self.eos_token_ids)
        self._params = file_named_tensors(self.model)  # HF file name -> tensor sharing the model's storage
        self._weight_version = 0
        self._seed_rng = random.Random(config.seed)

        self._queue: collections.deque[_Request] = collections.deque()
        self._live: dict[_Request, None] = {}  # every request not yet resolved, in arrival order
        self._batch = _Batch()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-engine")
        self._step_lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._resumed: asyncio.Event | None = None
        self._paused = False
        self.released_memory: tuple[str, ...] = ()  # release/resume_memory_occupation: bookkeeping only
        self._closed = False
        self._loop_task: asyncio.Task | None = None
        self._worker_ran = False  # the worker has stepped since its OpenMP team was last released
        if config.release_idle_threads:
            release_idle_threads()  # loading ran parallel ops on this thread; the worker steps from now on
        log.info("local engine ready: %s, vocab %d, eos %s, max_seq_len %d",
                 type(self.model).__name__, self.vocab_size, self.eos_token_ids, self.max_seq_len)

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> int:
        """How many times ``update_weights`` has been applied (one per weight sync)."""
        return self._weight_version

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self._closed:
            raise RuntimeError("LocalEngine is closed")
        prompt = self._validate_prompt(check_generate_args(prompt_ids, params))
        self._ensure_started()
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = _Request(
            prompt_ids=prompt,
            params=params,
            future=asyncio.get_running_loop().create_future(),
            rng=torch.Generator(device=self.device).manual_seed(seed),
            stop=StopStringMatcher(self.tokenizer, params.stop),
            weight_version_start=self._weight_version,
        )
        self._queue.append(request)
        self._live[request] = None
        self._wake.set()
        return await request.future

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                             version: int | None = None) -> None:
        """Copy HF-named tensors into the model in place, between two steps.

        All names and shapes are checked before anything is copied; unknown names, wrong
        shapes and non-floating tensors raise ValueError and leave the model unchanged. The weight
        version goes up by one, or becomes ``version`` (a resumed run's numbering).
        """
        updates = self._validate_updates(named_tensors)
        if "weights" in self.released_memory:
            raise RuntimeError("update_weights while the weights are released: resume_memory_occupation(['weights']) "
                               "first (SGLang's order; the local engine frees nothing but keeps it)")
        self._ensure_started()
        async with self._step_lock:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._copy_weights, updates)
            self._weight_version = self._weight_version + 1 if version is None else version
        log.info("updated %d tensors (weight version %d)", len(updates), self._weight_version)

    async def pause(self, *, mode: PauseMode | str = DEFAULT_PAUSE_MODE) -> None:
        """Stop admitting and stepping; returns once no step is running.

        ``ABORT``: requests in flight (queued ones too) finish now with ABORT and what they
        have generated so far. ``IN_PLACE``: they are held with their KV cache and continue
        after ``resume``. ``RETRACT``: they are held without it and prefilled again over
        prompt + generated ids on resume. ``generate`` calls made while paused wait.
        """
        mode = pause_mode(mode)
        self._ensure_started()
        self._paused = True
        self._resumed.clear()
        async with self._step_lock:
            if mode is PauseMode.ABORT:
                self._abort_all("paused in abort mode")
            elif mode is PauseMode.RETRACT:
                self._retract_all()

    async def resume(self) -> None:
        if self.released_memory:
            raise RuntimeError(f"resume with memory {list(self.released_memory)} still released: "
                               "resume_memory_occupation first (SGLang would generate into freed memory)")
        self._ensure_started()
        self._paused = False
        self._resumed.set()
        self._wake.set()

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's contract, freeing nothing (the model stays in memory): only while paused,
        a tag at most once; see :func:`~megatron_tir.rollout.engines.base.check_release`."""
        self.released_memory = check_release(self.released_memory, tags, paused=self._paused)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take back ``tags`` (None: all released); only tags that were released."""
        self.released_memory = check_resume(self.released_memory, tags)

    async def close(self) -> None:
        """Abort everything in flight and stop the scheduler; the engine cannot be reused."""
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        # Let a step still running in the worker finish before its requests are resolved.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        self._abort_all("engine closed")

    async def __aenter__(self) -> LocalEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ validation

    def _validate_prompt(self, prompt: list[int]) -> list[int]:
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) >= self.max_seq_len:
            raise ContextTooLong(f"prompt has {len(prompt)} tokens; the engine's max_seq_len is {self.max_seq_len}")
        return prompt

    def _validate_updates(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        updates = list(named_tensors)
        unknown = [name for name, _ in updates if name not in self._params]
        if unknown:
            example = next(iter(self._params))
            raise ValueError(
                f"update_weights: {len(unknown)} unknown parameter name(s) for {type(self.model).__name__}: "
                f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} (expected HF names like {example!r})"
            )
        for name, tensor in updates:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"update_weights: {name} is a {type(tensor).__name__}, not a torch.Tensor")
            if not tensor.is_floating_point():
                raise ValueError(f"update_weights: {name} has dtype {tensor.dtype}; expected a floating dtype")
            want = tuple(self._params[name].shape)
            if tuple(tensor.shape) != want:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}; the model has {want}")
        return updates

    def _check_full_attention(self) -> None:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        kinds = {type(layer).__name__ for layer in DynamicCache(config=self.model.config).layers}
        if kinds - {DynamicLayer.__name__}:
            raise ValueError(
                f"LocalEngine batches full-attention decoders only; {type(self.model).__name__} uses {sorted(kinds)}"
            )

    def _make_decoder(self) -> HFDecoder | SlotDecoder:
        kind = self.config.decoder
        if kind == "auto":
            kind = "slot" if supports_slot_decoder(self.model) else "hf"
        if kind == "slot":
            return SlotDecoder(self.model, self.device, self.config.max_batch_size, pack=self.config.pack_weights)
        return HFDecoder(self.model, self.device)

    def _resolve_eos(self) -> tuple[int, ...]:
        if self.config.eos_token_ids is not None:
            ids = tuple(dict.fromkeys(int(t) for t in self.config.eos_token_ids))
        else:
            ids = resolve_eos_token_ids(self.model_dir, self.config.extra_eos_tokens, tokenizer=self.tokenizer)
        if not ids:
            raise ValueError("eos_token_ids is empty")
        if any(t >= self.vocab_size for t in ids):
            raise ValueError(f"EOS ids {ids} outside the vocabulary of size {self.vocab_size}")
        return ids

    # ------------------------------------------------------------------ scheduler (event loop)

    def _ensure_started(self) -> None:
        loop = bind_event_loop(None if self._loop_task is None else self._loop_task.get_loop(), "LocalEngine")
        if self._loop_task is not None:
            return
        if self._closed:
            raise RuntimeError("LocalEngine is closed")
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._loop_task = loop.create_task(self._serve_requests(), name="local-engine-scheduler")
        self._loop_task.add_done_callback(self._on_scheduler_done)

    async def _serve_requests(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._paused:
                await self._resumed.wait()
                continue
            if not self._queue and not self._batch.requests:
                if self._worker_ran and self.config.release_idle_threads:
                    self._worker_ran = False
                    await loop.run_in_executor(self._executor, release_idle_threads)
                    continue  # requests may have come in meanwhile
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                if self._paused:
                    continue
                self._drop_cancelled()
                admitted = []
                while self._queue and len(self._batch.requests) + len(admitted) < self.config.max_batch_size:
                    admitted.append(self._queue.popleft())
                if not admitted and not self._batch.requests:
                    continue
                self._worker_ran = True
                try:
                    finished = await loop.run_in_executor(self._executor, self._step, admitted)
                except Exception as exc:  # a failed forward fails its requests, not the engine
                    log.exception("local engine step failed")
                    self._fail(self._batch.requests + admitted, RuntimeError(f"local engine step failed: {exc!r}"))
                    self._batch = _Batch()
                    continue
            for request in finished:
                self._resolve(request)
            await asyncio.sleep(0)  # let new requests in between steps

    def _on_scheduler_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("local engine scheduler crashed", exc_info=task.exception())
        self._closed = True
        self._fail(list(self._live), RuntimeError(f"local engine scheduler crashed: {task.exception()!r}"))

    def _fail(self, requests: list[_Request], exc: BaseException) -> None:
        for request in requests:
            self._live.pop(request, None)
            if not request.future.done():
                request.future.set_exception(exc)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._live if r.future.done()]:
            del self._live[request]
        self._queue = collections.deque(r for r in self._queue if not r.future.done())
        keep = [i for i, r in enumerate(self._batch.requests) if not r.future.done()]
        if len(keep) != len(self._batch.requests):
            self._select_rows(keep)

    def _resolve(self, request: _Request) -> None:
        self._live.pop(request, None)
        if request.future.done():  # cancelled by the caller
            return
        meta = {"weight_version_start": request.weight_version_start, "weight_version": self._weight_version,
                "weight_versions": [dict(span) for span in request.weight_spans]}
        if request.context_limit:
            meta["context_limit"] = True
        request.future.set_result(Generation(
            token_ids=list(request.token_ids),
            logprobs=list(request.logprobs),
            finish_reason=request.finish,
            matched_stop=request.matched_stop,
            prompt_tokens=len(request.prompt_ids),
            meta=meta,
            versions=[int(span["version"]) for span in request.weight_spans for _ in range(span["start"], span["end"])],
        ))

    def _abort_all(self, why: str) -> None:
        """Resolve every unresolved request: ABORT unless its last step already finished it."""
        requests = list(self._live)
        self._batch = _Batch()
        self._queue.clear()
        for request in requests:
            if request.finish is None:
                request.finish = FinishReason.ABORT
            self._resolve(request)
        if requests:
            log.info("aborted %d request(s): %s", len(requests), why)

    def _retract_all(self) -> None:
        """Drop the running batch's KV cache; its requests go back to the queue's front."""
        retracted = [r for r in self._batch.requests if r.finish is None]
        self._batch = _Batch()
        self._queue.extendleft(reversed(retracted))
        if retracted:
            log.info("retracted %d request(s)", len(retracted))

    # ------------------------------------------------------------------ model steps (worker thread)

    @torch.inference_mode()
    def _step(self, admitted: list[_Request]) -> list[_Request]:
        """Prefill the admitted requests, or else decode one token for the running batch."""
        batch = self._batch
        if admitted:
            # A retracted request resumes where it was: prompt + generated ids.
            contexts = [r.prompt_ids + r.token_ids for r in admitted]
            reuse = self._reuse(contexts)
            batch.cache, logits_NV = self._decoder.prefill(batch.cache, contexts, reuse=reuse)
            for request in admitted:
                request.kv_version = self._weight_version
            token_N, finished = self._advance(admitted, logits_NV)
            batch.requests = batch.requests + admitted
            batch.pending_B = token_N if batch.pending_B is None else torch.cat([batch.pending_B, token_N])
        else:
            logits_BV = self._decoder.decode(batch.cache, batch.pending_B)
            batch.pending_B, finished = self._advance(batch.requests, logits_BV)
        keep = [i for i, r in enumerate(batch.requests) if r.finish is None]
        if len(keep) != len(batch.requests):
            self._keep_prefixes([i for i, r in enumerate(batch.requests) if r.finish is not None])
            self._select_rows(keep)
        return finished

    def _reuse(self, contexts: list[list[int]]) -> list | None:
        """Per context, where its leading tokens' K/V can come from: the prefix cache's best entry or
        an earlier context of the same prefill, whichever shares more (None: all computed)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        reuse = []
        for i, context in enumerate(contexts):
            entry, n = cache.match(context)
            best = (entry, n) if n else None
            for j in range(i):
                shared = min(common_prefix(contexts[j], context), len(context) - 1)
                if shared > (best[1] if best else 0):
                    best = (j, shared)
            reuse.append(best)
            if best is not None:
                cache.hits += 1
                cache.reused_tokens += best[1]
            cache.prefilled_tokens += len(context) - (best[1] if best else 0)
        return reuse

    def _keep_prefixes(self, rows: list[int]) -> None:
        """Store the K/V of the finished ``rows`` whose K/V are all under the current weights."""
        cache, batch = self.prefix_cache, self._batch
        if cache is None:
            return
        for row in rows:
            request = batch.requests[row]
            if request.kv_version != self._weight_version:  # it continued across a weight update
                continue
            n = batch.cache.lengths[row]
            keys, values = self._decoder.row_kv(batch.cache, row)
            cache.insert((request.prompt_ids + request.token_ids)[:n], keys, values)

    def _advance(self, requests: list[_Request], logits_BV: torch.Tensor) -> tuple[torch.Tensor, list[_Request]]:
        """Sample one token per row, record it, and mark rows that finished; returns (tokens, finished)."""
        device = logits_BV.device
        temperature_B = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32, device=device)
        top_p_B = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32, device=device)
        top_k_B = torch.tensor([r.params.top_k for r in requests], dtype=torch.long, device=device)
        vocab = logits_BV.shape[1]
        uniform_BV = torch.stack([torch.rand(vocab, generator=r.rng, device=device) for r in requests])
        token_B, logprob_B = sample_tokens(logits_BV, temperature_B=temperature_B, top_p_B=top_p_B,
                                           top_k_B=top_k_B, uniform_BV=uniform_BV)
        finished = []
        version = str(self._weight_version)
        for request, token, logprob in zip(requests, token_B.tolist(), logprob_B.tolist()):
            request.token_ids.append(token)
            request.logprobs.append(logprob)
            spans = request.weight_spans
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] += 1
            else:
                n = len(request.token_ids)
                spans.append({"version": version, "start": n - 1, "end": n})
            if token in self._eos:
                request.finish = FinishReason.EOS
            elif (matched := request.stop.check(request.token_ids)) is not None:
                request.finish, request.matched_stop = FinishReason.STOP, matched
            elif len(request.token_ids) >= request.params.max_new_tokens:
                request.finish = FinishReason.LENGTH
            elif len(request.prompt_ids) + len(request.token_ids) >= self.max_seq_len:
                request.finish, request.context_limit = FinishReason.LENGTH, True
            if request.finish is not None:
                finished.append(request)
        return token_B, finished

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the running batch (the decoder may reorder them)."""
        batch = self._batch
        if not keep:
            self._batch = _Batch()
            return
        batch.cache, order = self._decoder.keep_rows(batch.cache, keep)
        batch.requests = [batch.requests[i] for i in order]
        batch.pending_B = batch.pending_B[torch.tensor(order, dtype=torch.long, device=batch.pending_B.device)]

    @torch.inference_mode()
    def _copy_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in updates:
            self._params[name].copy_(tensor)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # its K/V were computed under the old weights
        if isinstance(self._decoder, SlotDecoder):
            self._decoder.weights_changed([self._params[name] for name, _ in updates])
