"""Guided decoding: a client's grammar (JSON schema, regex, choice list, EBNF) as a per-token mask.

xgrammar compiles a grammar once against the model's vocabulary; each sequence then holds a matcher
that, before every token, fills one bitmask row of the tokens the grammar allows next (about 10 us on
SmolLM2's 49k vocabulary here, against 10 ms for llguidance's CPU mask application:
docs/decisions/guided-decoding.md). Compiled grammars are cached (bounded LRU) by their source.

A grammar is hostile input. Its source is bounded in size and a JSON schema in shape (depth,
values, properties) before anything compiles; compilation runs in worker processes that are killed
at the deadline, one compile per tenant at a time, tenants served round robin (backend/engine/guide_pool.py).
A grammar that does not compile (or not in time) is a `GuideError`, which the HTTP layers answer
with a 400 naming the field it came from.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ctxgate.backend.engine.guide_pool import CompileFailed, CompilePool, CompileRefused

if TYPE_CHECKING:
    import xgrammar

    from ctxgate.backend.model.tokenizer import Tokenizer

GuideKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

MAX_GUIDE_SOURCE_CHARS = 32_000  # a schema / regex / grammar longer than this is refused
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1_000
# A JSON schema's shape, checked before it compiles. xgrammar's cost grows with the square of an
# object's optional properties and faster than linearly in their total; every schema at these caps
# we tried compiles in about 1 s or less (docs/api.md), and anything slower is stopped by the deadline.
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects and arrays in the schema document
MAX_SCHEMA_NODES = 4_096  # JSON values in the schema document
MAX_OBJECT_PROPERTIES = 128  # in one "properties"
MAX_SCHEMA_PROPERTIES = 1_024  # in all "properties" together
COMPILE_TIMEOUT_S = 5.0  # the worker compiling longer is killed
QUEUE_WAIT_S = 10.0  # a compile not started by then is refused (503)
MAX_QUEUED_PER_TENANT = 8  # more waiting compiles of one tenant are refused (429)
CACHE_SIZE = 64
COMPILE_WORKERS = 2
ANONYMOUS_TENANT = "-"  # callers that name no tenant share one fair-queue place


class GuideError(ValueError):
    """A guide the engine cannot use; `param` is the client field it came from."""

    def __init__(self, message: str, param: str, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class GuideSpec:
    """What to constrain the output to, as the client said it (`param`: the field it came from)."""

    kind: GuideKind
    source: str  # a JSON schema's canonical text, a regex, an EBNF grammar, or a JSON list of choices
    param: str

    def check_size(self) -> None:
        if len(self.source) > MAX_GUIDE_SOURCE_CHARS:
            raise GuideError(
                f"{self.param} is {len(self.source)} characters; at most {MAX_GUIDE_SOURCE_CHARS} "
                "are compiled",
                self.param,
            )

    @classmethod
    def json_schema(cls, schema: object, param: str, wrapper_depth: int = 0) -> GuideSpec:
        """`wrapper_depth`: levels the server itself wrapped around the client's schemas."""
        if not isinstance(schema, dict):
            raise GuideError(f"{param} must be a JSON schema object", param)
        check_schema_shape(schema, param, wrapper_depth)
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices: object, param: str) -> GuideSpec:
        if (
            not isinstance(choices, list)
            or not choices
            or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in choices)
        ):
            raise GuideError(
                f"{param} must be a list of 1 to {MAX_CHOICES} non-empty strings of at most "
                f"{MAX_CHOICE_CHARS} characters",
                param,
            )
        return cls("choice", json.dumps(choices, ensure_ascii=False), param)


def check_schema_shape(schema: object, param: str, wrapper_depth: int = 0) -> None:
    """A GuideError naming `param` when the schema nests, or holds, more than a compile can afford."""
    max_depth = MAX_SCHEMA_DEPTH + wrapper_depth
    nodes = properties = 0
    stack: list[tuple[object, int]] = [(schema, 1)]  # iterative: a deep document must not recurse
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise GuideError(f"{param} has more than {MAX_SCHEMA_NODES} JSON values; simplify it", param)
        if isinstance(value, dict):
            declared = value.get("properties")
            if isinstance(declared, dict):
                properties += len(declared)
                if len(declared) > MAX_OBJECT_PROPERTIES:
                    raise GuideError(
                        f"{param} declares {len(declared)} properties in one object; at most "
                        f"{MAX_OBJECT_PROPERTIES} are compiled",
                        param,
                    )
                if properties > MAX_SCHEMA_PROPERTIES:
                    raise GuideError(
                        f"{param} declares more than {MAX_SCHEMA_PROPERTIES} properties in all; simplify it",
                        param,
                    )
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            raise GuideError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels; simplify it", param)
        stack.extend((child, depth + 1) for child in children)


class Guide:
    """A compiled grammar: immutable, shared by every sequence constrained by the same source."""

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self._compiled = compiled
        # The bitmask width its matchers fill: a model with a smaller vocabulary cannot use it.
        self.vocab_size: int = compiled.tokenizer_info.vocab_size

    def matcher(self) -> GuideMatcher:
        import xgrammar

        return GuideMatcher(xgrammar.GrammarMatcher(self._compiled))


class GuideMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (xgrammar's packed int32 layout)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar does not allow it."""
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens forbidden until a matcher fills its row (ids past the tokenizer's stay forbidden)."""
    return torch.zeros(rows, -(-vocab_size // 32), dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids, in the given rows only."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), indices=rows, vocab_size=logits.shape[-1]
    )


class GuideCompiler:
    """Compiles `GuideSpec`s for one tokenizer; results cached, compilation in killable workers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        cache_size: int = CACHE_SIZE,
        timeout_s: float = COMPILE_TIMEOUT_S,
        workers: int = COMPILE_WORKERS,
        queue_wait_s: float = QUEUE_WAIT_S,
        max_queued_per_tenant: int = MAX_QUEUED_PER_TENANT,
    ):
        self._tokenizer = tokenizer
        # Compiled grammars, and the messages of grammars that do not compile (deterministic: a
        # flood of one broken grammar costs one compile). Timeouts are not kept: load can cause them.
        self._cache: OrderedDict[tuple[str, str], Guide | str] = OrderedDict()
        self._cache_size = cache_size
        self._timeout_s = timeout_s
        self._pool_settings = (workers, timeout_s, queue_wait_s, max_queued_per_tenant)
        self._lock = threading.Lock()
        self._info: xgrammar.TokenizerInfo | None = None
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._pool: CompilePool | None = None

    def _tokenizer_info(self) -> xgrammar.TokenizerInfo:
        import xgrammar

        with self._lock:
            if self._info is None:
                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer.hf,
                    vocab_size=self._tokenizer.vocab_size,
                    stop_token_ids=sorted(self._tokenizer.eos_token_ids),
                )
            return self._info

    def _workers(self) -> CompilePool:
        info = self._tokenizer_info()
        with self._lock:
            if self._pool is None:
                workers, timeout_s, queue_wait_s, max_queued = self._pool_settings
                self._pool = CompilePool(
                    info.serialize_json(),
                    self._deserialize,
                    self._compile_here,
                    workers,
                    timeout_s,
                    queue_wait_s,
                    max_queued,
                )
            return self._pool

    def warm_up(self) -> None:
        """Start the workers now (blocking only for the tokenizer info), not on the first request."""
        self._workers()

    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids() if self._pool is not None else []

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _cached(self, spec: GuideSpec) -> Guide | None:
        key = (spec.kind, spec.source)
        with self._lock:
            cached = self._cache.get(key)
            if cached is None:
                return None
            self._cache.move_to_end(key)
        if isinstance(cached, str):
            raise GuideError(f"{spec.param} could not be compiled: {cached}", spec.param)
        return cached

    def _remember(self, spec: GuideSpec, result: Guide | str) -> None:
        with self._lock:
            self._cache[(spec.kind, spec.source)] = result
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def compile_now(self, spec: GuideSpec) -> Guide:
        """Compile (or fetch from the cache) on this thread, with no deadline: for the server's own
        grammars (benchmarks, tests), never a client's."""
        spec.check_size()
        cached = self._cached(spec)
        if cached is not None:
            return cached
        try:
            guide = Guide(self._compile_here(spec.kind, spec.source))
        except (RuntimeError, ValueError, TypeError) as exc:
            self._remember(spec, first_line(exc))
            raise GuideError(f"{spec.param} could not be compiled: {first_line(exc)}", spec.param) from None
        self._remember(spec, guide)
        return guide

    def _compile_here(self, kind: str, source: str) -> xgrammar.CompiledGrammar:
        import xgrammar

        info = self._tokenizer_info()
        with self._lock:
            if self._compiler is None:
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiler = self._compiler
        return compile_source(compiler, kind, source)

    async def compile(self, spec: GuideSpec, tenant: str = ANONYMOUS_TENANT) -> Guide:
        """The compiled grammar from the cache, or from a worker process: at most one compile of
        `tenant` at a time, tenants in turn, the worker killed at the deadline."""
        spec.check_size()
        cached = self._cached(spec)
        if cached is not None:
            return cached
        pool = await asyncio.to_thread(self._workers)  # the first call builds the tokenizer info
        try:
            future = pool.submit(tenant, spec.kind, spec.source)
        except CompileRefused as exc:
            raise GuideError(f"{spec.param} {exc}", spec.param, exc.status) from None
        try:
            # The pool answers every job within its queue wait plus the deadline; this bound is a
            # backstop, and cancelling here drops the job if it has not started.
            compiled = await asyncio.wait_for(asyncio.wrap_future(future), pool.answer_within_s())
        except CompileRefused as exc:
            raise GuideError(f"{spec.param} {exc}", spec.param, exc.status) from None
        except CompileFailed as exc:
            self._remember(spec, str(exc))
            raise GuideError(f"{spec.param} could not be compiled: {exc}", spec.param) from None
        except TimeoutError:
            raise GuideError(f"{spec.param} did not compile in time; retry", spec.param, 503) from None
        guide = Guide(compiled)
        self._remember(spec, guide)
        return guide

    def _deserialize(self, serialized: str) -> xgrammar.CompiledGrammar:
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info())


def compile_source(compiler: xgrammar.GrammarCompiler, kind: str, source: str) -> xgrammar.CompiledGrammar:
    """Compile one grammar; xgrammar's RuntimeError / ValueError / TypeError when it does not."""
    if kind == "json_schema":
        # No free whitespace: a small model can otherwise pad an answer with spaces forever.
        return compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "choice":
        alternatives = " | ".join(_ebnf_literal(c) for c in json.loads(source))
        return compiler.compile_grammar(f"root ::= {alternatives}")
    return compiler.compile_grammar(source)


def _ebnf_literal(text: str) -> str:
    # An EBNF string literal: JSON's escapes are a subset of what xgrammar's EBNF reads.
    return json.dumps(text, ensure_ascii=True)


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[19:06:55] /project/cpp/x.cc:12: "


def first_line(exc: Exception) -> str:
    # xgrammar's messages can be long (a whole grammar dump); the first line names the problem. Its
    # time stamp and C++ source location say nothing to a client (and are a path of the server's).
    text = str(exc).strip().splitlines()
    return _SOURCE_PREFIX.sub("", text[0] if text else type(exc).__name__)[:300]


_COMPILERS: dict[int, GuideCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer) -> GuideCompiler:
    """The process's compiler for this tokenizer (one per tokenizer object: its cache is shared)."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(id(tokenizer))
        if compiler is None or compiler._tokenizer is not tokenizer:
            if compiler is not None:
                compiler.close()  # its tokenizer is gone (the id was reused): end its workers
            compiler = _COMPILERS[id(tokenizer)] = GuideCompiler(tokenizer)
        return compiler
