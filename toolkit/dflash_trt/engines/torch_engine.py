"""The torch engine: DFlash speculative decoding over a Hugging Face target, on CPU or CUDA.

It is the reference engine: the one the CLI, the verify stage and the CPU Triton model run, and
the one other engines are checked against. With max_batch_size 1 requests are served one at a
time (a lock) by dflash.generate, the batch-1 reference; above 1 they are batched continuously
(engines.scheduler over dflash.batch): up to max_batch_size requests share each drafter pass and
verify forward, more wait in a bounded queue.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

from dflash_trt.engines import cpu_threads
from dflash_trt.engines.base import SamplingParams, StepOutput
from dflash_trt.engines.detokenize import IncrementalDetokenizer, StopWordFilter
from dflash_trt.errors import DflashTrtError, UsageError
from dflash_trt.prompts import encode_prompt


def _pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    return device


def _stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config (what HF generate stops on), else the tokenizer's."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return [int(i) for i in ids]


class TorchEngine:
    """Engine protocol implementation (see engines/base.py) over dflash.generate."""

    def __init__(self, model, tokenizer, drafter, *, device: str, block_size: int,
                 max_seq_len: int, prompt_lookup: bool = False, max_batch_size: int = 1,
                 max_queue: int = 64, queue_timeout_s: float = 60.0, threads: int | None = None,
                 prefix_cache_tokens: int = 0):
        from dflash_trt.dflash.target import HFTarget

        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.device = device
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.prompt_lookup = prompt_lookup  # n-gram drafts before the drafter (dflash.lookup)
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.target = HFTarget(model, drafter.target_layer_ids if drafter is not None else None)
        self.stop_token_ids = _stop_token_ids(model, tokenizer)
        self._lock = threading.Lock()
        # Serving rests a drafter that keeps missing (lossless, see dflash.generate); `eval` and
        # `verify` turn it off so acceptance lengths measure the drafter itself.
        self.draft_backoff = True
        # Adaptive draft length (dflash.draft_length): set a cost model measured on this device
        # (engines.cost_model) and each drafter step verifies only the drafts worth their cost.
        self.cost_model = None
        # Confidence -> P(accepted), calibrated on measured acceptance (dflash.acceptance); None:
        # the chooser trusts the drafter's raw confidence.
        self.acceptance = None
        # Continuous batching above 1 (engines.scheduler): rows per step, waiting requests, and
        # how long one may wait for a row before it gets an error.
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.queue_timeout_s = queue_timeout_s
        self.prefix_cache_tokens = prefix_cache_tokens  # kept for later prompts (dflash.prefix)
        self._scheduler = None  # started by the first batched request
        self.threads = threads  # torch CPU threads for the scheduler's thread (engines.cpu_threads)
        # Batching: verify forwards packed, prompt chunks in them (dflash.batch), where the target
        # can (HFTarget.packs); False pads every row to the widest, each prompt on its own.
        self.packed = True
        self._starting = threading.Lock()

    @classmethod
    def load(cls, target_dir: Path, drafter_dir: Path | None, *, device: str = "cpu",
             dtype: str = "float32", block_size: int | None = None,
             max_seq_len: int = 2048, prompt_lookup: bool = False, max_batch_size: int = 1,
             max_queue: int = 64, queue_timeout_s: float = 60.0,
             prefix_cache_tokens: int = 0) -> TorchEngine:
        """Load a target checkpoint (and optionally a drafter) from resolved directories."""
        from transformers import AutoTokenizer

        from dflash_trt.formats.load import load_drafter, load_target

        device = _pick_device(device)
        target_dir = Path(target_dir)
        # Batched, the scheduler thread computes: the loading thread must not own threads too.
        with cpu_threads.loading(device if max_batch_size > 1 else None) as threads:
            model = load_target(target_dir, dtype=dtype, device=device)
            _pack_for_cpu(model)
            tokenizer = AutoTokenizer.from_pretrained(target_dir)
            drafter = None
            if drafter_dir is not None:
                drafter = load_drafter(Path(drafter_dir), dtype=dtype, device=device)
                _pack_for_cpu(drafter)
                _check_pair(model, drafter, drafter_dir)
        if block_size is None:
            block_size = drafter.block_size if drafter is not None else 1
        if block_size < 1:
            raise UsageError(f"block_size must be >= 1 (got {block_size})")
        if block_size > 1 and drafter is None:
            raise UsageError(f"block_size {block_size} needs a drafter; pass a drafter directory "
                             "or use block_size 1")
        if prompt_lookup and block_size <= 1:
            raise UsageError("prompt lookup drafts alongside a DFlash drafter and uses its block "
                             "size; pass a drafter or turn prompt lookup off")
        if max_seq_len < 2:
            raise UsageError(f"max_seq_len must be >= 2 (got {max_seq_len})")
        if max_batch_size > 1:
            _check_batchable(model, target_dir)
        return cls(model, tokenizer, drafter, device=device, block_size=block_size,
                   max_seq_len=max_seq_len, prompt_lookup=prompt_lookup,
                   max_batch_size=max_batch_size, max_queue=max_queue,
                   queue_timeout_s=queue_timeout_s, threads=threads,
                   prefix_cache_tokens=prefix_cache_tokens)

    def tokenize(self, prompt: str, chat: bool = False,
                 parse_special_tokens: bool = False) -> list[int]:
        """Token ids for a prompt (see prompts.encode_prompt)."""
        return encode_prompt(self.tokenizer, prompt, chat,
                             parse_special_tokens=parse_special_tokens)

    def next_token_logits(self, ids: Sequence[int]):
        """The target's float32 logits (V,) for the token after `ids`, from one forward."""
        import torch

        with self._lock, torch.inference_mode():
            tensor = torch.tensor([list(ids)], device=self.target.device)
            hidden, _ = self.target.forward(tensor, self.target.new_cache(), capture=False)
            return self.target.logits(hidden[0, -1])

    def _check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise UsageError("the prompt is empty; give at least one token")
        if params.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1 (got {params.max_new_tokens})")
        if params.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (got {params.temperature})")
        if not 0 < params.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1] (got {params.top_p})")
        if params.top_k < 0:
            raise UsageError(f"top_k must be >= 0 (got {params.top_k})")
        if params.num_draft_tokens is not None and params.num_draft_tokens < 0:
            raise UsageError(f"num_draft_tokens must be >= 0 (got {params.num_draft_tokens})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_seq_len:
            raise UsageError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                             f"({params.max_new_tokens}) exceeds max_seq_len {self.max_seq_len}")
        vocab = self.target.embed_tokens.num_embeddings
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise UsageError(f"prompt token ids must be in [0, {vocab})")
        if params.end_id is not None and not 0 <= params.end_id < vocab:
            raise UsageError(f"end_id must be a token id in [0, {vocab}) (got {params.end_id})")
        if any(not word or min(word) < 0 or max(word) >= vocab for word in params.bad_words):
            raise UsageError(f"bad_words must be non-empty token sequences in [0, {vocab})")

    def _sampler(self, params: SamplingParams):
        import torch

        from dflash_trt.dflash.sampling import Sampler

        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device=self.device)
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
        return Sampler(params.temperature, params.top_k, params.top_p, generator)

    def _draft_length(self):
        if self.cost_model is None or self.drafter is None:
            return None  # fixed: every drafter step verifies all its drafts
        from dflash_trt.dflash.draft_length import choose_draft_length

        return partial(choose_draft_length, costs=self.cost_model.costs,
                       acceptance=self.acceptance)

    def _batch(self):
        """The scheduler of batched serving, started on first use."""
        with self._starting:
            return self._scheduler or self._start_scheduler()

    def _start_scheduler(self):
        from dflash_trt.dflash.batch import BatchDecoder
        from dflash_trt.engines.scheduler import Scheduler

        choose = pays = timing = None
        packed = self.packed and self.target.packs
        if self.cost_model is not None and self.drafter is not None:  # adaptive
            from dflash_trt.dflash.draft_length import drafting_pays
            from dflash_trt.dflash.policy import draft_chooser
            from dflash_trt.engines.cost_model import OnlineCosts

            costs = OnlineCosts(self.cost_model)
            choose = draft_chooser(costs.step_s, costs.verify_s, packed)
            pays = partial(drafting_pays, verify_s=costs.verify_s, draft_s=costs.draft_s,
                           max_drafts=self.block_size - 1, packed=packed)
            timing = costs.record
        decoder = BatchDecoder(self.target, self.drafter, block_size=self.block_size,
                               max_rows=self.max_batch_size, max_seq_len=self.max_seq_len,
                               prompt_lookup=self.prompt_lookup, backoff=self.draft_backoff,
                               choose=choose, pays=pays, acceptance=self.acceptance,
                               timing=timing, packed=packed,
                               prefix_tokens=self.prefix_cache_tokens)
        self._scheduler = Scheduler(decoder, self._lock, max_queue=self.max_queue,
                                    queue_timeout_s=self.queue_timeout_s, threads=self.threads)
        return self._scheduler

    def close(self) -> None:
        """Stop the batching thread (requests in flight get an error)."""
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StepOutput]:
        """One StepOutput per target forward; closing the iterator early stops generation."""
        self._check(prompt_ids, params)
        stops = [*self.stop_token_ids, *([] if params.end_id is None else [params.end_id])]
        if self.max_batch_size > 1:
            from dflash_trt.dflash.batch import Request

            ticket = self._batch().submit(Request(
                prompt_ids, params.max_new_tokens, self._sampler(params), stops,
                params.num_draft_tokens, params.bad_words))
            try:
                yield from self._outputs(iter(ticket), params)
            finally:
                ticket.cancel()  # frees the row at the next step when the client went away
            return
        from dflash_trt.dflash.generate import generate_steps

        with self._lock:  # released on normal end, on error, and on generator close()
            steps = generate_steps(self.target, self.drafter, prompt_ids,
                                   max_new_tokens=params.max_new_tokens,
                                   block_size=self.block_size,
                                   num_draft_tokens=params.num_draft_tokens,
                                   stop_token_ids=stops,
                                   sampler=self._sampler(params),
                                   backoff=self.draft_backoff,
                                   prompt_lookup=self.prompt_lookup,
                                   draft_length=self._draft_length(),
                                   bad_words=params.bad_words)
            try:
                yield from self._outputs(steps, params)
            finally:
                steps.close()

    def _outputs(self, steps, params: SamplingParams) -> Iterator[StepOutput]:
        """StepOutputs with text (stop words applied) from dflash Steps, up to the last one."""
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopWordFilter(params.stop_words)
        for step in steps:
            text, stopped = stops.push(detok.push(step.token_ids))
            finish = "stop" if stopped else step.finish_reason
            if finish is not None and not stopped:  # the end: release held-back text
                tail, stopped = stops.push(detok.flush())
                text += tail if stopped else tail + stops.flush()
                finish = "stop" if stopped else finish
            yield StepOutput(tuple(step.token_ids), text, step.num_draft_tokens,
                             step.num_accepted_draft_tokens, finish is not None, finish,
                             step.draft_source, step.draft_confidence,
                             cached_tokens=step.cached_tokens)
            if finish is not None:
                return


def _pack_for_cpu(model) -> None:
    """float32 on CPU: the model's linear layers through oneDNN with packed weights, several
    times faster than the default kernels for the few rows of a verify forward or a batch, and
    NVFP4 ones through a float16 kernel for calls of up to dflash.cpu_fp16.max_rows() rows
    (dflash.cpu_linear, dflash.cpu_fp16).
    Elsewhere the NVFP4 weights kept as stored for that kernel are dropped."""
    import torch

    from dflash_trt.dflash import cpu_linear

    param = next(model.parameters())
    if param.device.type == "cpu" and param.dtype == torch.float32 and cpu_linear.available():
        cpu_linear.pack_linears(model)
    for module in model.modules():
        if getattr(module, "stored", None) is not None:
            module.stored = None


def _check_batchable(model, target_dir) -> None:
    """Batched rows need sdpa-style attention over the whole cache with a mask per row."""
    from dflash_trt.dflash.attention import NAME, sliding_window

    if sliding_window(model.config):
        raise UsageError(f"{target_dir}: sliding-window attention is not batched by the torch "
                         "engine; set engine.max_batch_size: 1")
    if model.config._attn_implementation == NAME:
        raise UsageError(f"{target_dir}: in half precision the torch engine verifies with "
                         "row-wise attention, which serves batch 1 only; set engine.dtype: "
                         "float32 or engine.max_batch_size: 1")


def _check_pair(model, drafter, drafter_dir) -> None:
    """The drafter must match the target's hidden size and layer count."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if drafter.config.hidden_size != config.hidden_size:
        raise DflashTrtError(f"{drafter_dir}: drafter hidden_size {drafter.config.hidden_size} != "
                             f"target hidden_size {config.hidden_size}; use a drafter for this target")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise DflashTrtError(f"{drafter_dir}: target_layer_ids {bad} do not exist in a "
                             f"{config.num_hidden_layers}-layer target")
    if drafter.mask_token_id is None or not 0 <= drafter.mask_token_id < config.vocab_size:
        raise DflashTrtError(f"{drafter_dir}: dflash_config.mask_token_id "
                             f"{drafter.mask_token_id} is not a token of the target")
    vocab = drafter.draft_vocab
    if vocab is not None and int(vocab.max()) >= model.get_output_embeddings().weight.shape[0]:
        raise DflashTrtError(f"{drafter_dir}: draft_vocab.json names token {int(vocab.max())}, "
                             "outside the target's vocabulary; use a drafter for this target")
