"""Guided decoding: a client's grammar (JSON schema, regex, choice list, EBNF) as a per-token mask.

xgrammar compiles a grammar once against the model's vocabulary; each sequence then holds a matcher
that, before every token, fills one bitmask row of the tokens the grammar allows next (about 10 us on
SmolLM2's 49k vocabulary here, against 10 ms for llguidance's CPU mask application:
docs/decisions/guided-decoding.md). Compiled grammars are cached (bounded LRU) by their source.

A grammar is hostile input: its source is bounded in size, compiled off the event loop on a small
pool, and given a deadline; a grammar that does not compile (or not in time) is a `GuideError`,
which the HTTP layers answer with a 400 naming the field it came from.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    import xgrammar

    from backend.tokenizer import Tokenizer

GuideKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

MAX_GUIDE_SOURCE_CHARS = 32_000  # a schema / regex / grammar longer than this is refused
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1_000
COMPILE_TIMEOUT_S = 5.0
CACHE_SIZE = 64
COMPILE_WORKERS = 2


class GuideError(ValueError):
    """A guide the engine cannot use; `param` is the client field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GuideSpec:
    """What to constrain the output to, as the client said it (`param`: the field it came from)."""

    kind: GuideKind
    source: str  # a JSON schema's canonical text, a regex, an EBNF grammar, or a JSON list of choices
    param: str

    def check_size(self) -> None:
        if len(self.source) > MAX_GUIDE_SOURCE_CHARS:
            raise GuideError(f"{self.param} is {len(self.source)} characters; at most {MAX_GUIDE_SOURCE_CHARS} "
                             "are compiled", self.param)

    @classmethod
    def json_schema(cls, schema: object, param: str) -> GuideSpec:
        if not isinstance(schema, dict):
            raise GuideError(f"{param} must be a JSON schema object", param)
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices: object, param: str) -> GuideSpec:
        if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in choices)):
            raise GuideError(f"{param} must be a list of 1 to {MAX_CHOICES} non-empty strings of at most "
                             f"{MAX_CHOICE_CHARS} characters", param)
        return cls("choice", json.dumps(choices, ensure_ascii=False), param)


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

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows,
                                         vocab_size=logits.shape[-1])


class GuideCompiler:
    """Compiles `GuideSpec`s for one tokenizer; results cached, compilation off the caller's loop."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE, timeout_s: float = COMPILE_TIMEOUT_S):
        self._tokenizer = tokenizer
        self._cache: OrderedDict[tuple[str, str], Guide] = OrderedDict()
        self._cache_size = cache_size
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="ctxgate-guide")

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer.hf, vocab_size=self._tokenizer.vocab_size,
                    stop_token_ids=sorted(self._tokenizer.eos_token_ids))
                # Our own LRU below bounds memory; xgrammar's unbounded cache would not.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile_now(self, spec: GuideSpec) -> Guide:
        """Compile (or fetch from the cache) on this thread; GuideError when it does not compile."""
        spec.check_size()
        key = (spec.kind, spec.source)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        guide = Guide(self._compile(spec))
        with self._lock:
            self._cache[key] = guide
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return guide

    async def compile(self, spec: GuideSpec) -> Guide:
        """`compile_now` on the compile pool, with a deadline."""
        spec.check_size()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self.compile_now, spec)
        try:
            return await asyncio.wait_for(future, self._timeout_s)
        except TimeoutError:
            raise GuideError(f"{spec.param} did not compile within {self._timeout_s:g}s; simplify it",
                             spec.param) from None

    def _compile(self, spec: GuideSpec) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar()
        try:
            if spec.kind == "json_schema":
                # No free whitespace: a small model can otherwise pad an answer with spaces forever.
                return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                alternatives = " | ".join(_ebnf_literal(c) for c in json.loads(spec.source))
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GuideError(f"{spec.param} could not be compiled: {_first_line(exc)}", spec.param) from None


def _ebnf_literal(text: str) -> str:
    # An EBNF string literal: JSON's escapes are a subset of what xgrammar's EBNF reads.
    return json.dumps(text, ensure_ascii=True)


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[19:06:55] /project/cpp/x.cc:12: "


def _first_line(exc: Exception) -> str:
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
            compiler = _COMPILERS[id(tokenizer)] = GuideCompiler(tokenizer)
        return compiler
