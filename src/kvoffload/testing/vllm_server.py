"""``vllm serve`` for tests and benchmarks: a local tokenizer and a server subprocess.

The random checkpoints of ``kvoffload.demos.tiny_model`` ship without a tokenizer,
but ``vllm serve`` and ``vllm bench serve`` need one. :func:`write_tokenizer` builds
one locally (no downloads) whose vocabulary is exactly the model's ids, so random
token ids survive decode-then-encode unchanged.

:class:`VllmServer` runs ``vllm serve MODEL`` (the ``vllm`` executable next to
``sys.executable``) on a free loopback port, in its own session, logging to a file.
``start()`` returns once ``GET /health`` answers 200, or raises with the log's tail
if the process exits first or the deadline passes; ``stop()`` ends it by its own
pid (SIGTERM, then SIGKILL of its process group after a grace period). It is also a
context manager: ``with VllmServer(...) as server:`` starts and always stops it.
``launch()`` + ``wait_exit()`` are for servers expected to fail at start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvoffload.testing.ports import free_port

#: Engine KV-cache bytes of :class:`VllmServer` unless the caller says otherwise.
DEFAULT_KV_CACHE_BYTES = 32 << 20

#: Token text of id ``i`` (ids not reserved for special tokens).
TOKEN_FORMAT = "t{}"

#: A chat template over the tokenizer's own words: roles render as ``<unk>`` (they
#: are not in the vocabulary), every message ends with the eos token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }} {{ message['content'] }} {{ eos_token }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)

_SPECIAL_NAMES = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def token_text(token_id: int) -> str:
    """The text :func:`write_tokenizer` gives a non-special id (``t<id>``)."""
    return TOKEN_FORMAT.format(token_id)


def special_token_ids(model_dir: Path, vocab_size: int) -> dict[str, int]:
    """Ids of the special tokens :func:`write_tokenizer` reserves, by role.

    bos/eos/pad take the ids of ``config.json`` (``bos_token_id``, ``eos_token_id``,
    ``pad_token_id``; a list of eos ids keeps its first) when present and inside the
    vocabulary, else the smallest ids not yet taken; unk always takes the smallest
    free id. Two roles sharing one id in the config share the token too.
    Raises ``ValueError`` when ``vocab_size`` cannot hold the four roles plus one word.
    """
    if vocab_size < len(_SPECIAL_NAMES) + 1:
        raise ValueError(f"vocab_size: {vocab_size} too small; accepted: >= 5")
    config: dict[str, Any] = {}
    config_path = model_dir / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
    ids: dict[str, int] = {}
    for role in ("bos", "eos", "pad"):
        value = config.get(f"{role}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
            ids[role] = value
    for role in ("bos", "eos", "pad", "unk"):
        if role not in ids:
            ids[role] = min(set(range(vocab_size)) - set(ids.values()))
    return ids


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Write a Hugging Face fast tokenizer covering ids ``0..vocab_size-1`` into ``model_dir``.

    Built with the ``tokenizers`` library, nothing downloaded: a WordLevel model whose
    word for id ``i`` is ``t<i>`` except the special ids of :func:`special_token_ids`
    (``<s>``, ``</s>``, ``<pad>``, ``<unk>``), a Whitespace pre-tokenizer (words are
    separated by spaces; decoding joins tokens with one space), and the Jinja
    :data:`CHAT_TEMPLATE`. Saved with ``PreTrainedTokenizerFast.save_pretrained``
    (``tokenizer.json``, ``tokenizer_config.json``, ...), overwriting any tokenizer
    files there; the model's own files are untouched.

    Contract: ``len(tokenizer) == tokenizer.vocab_size == vocab_size``, and for any ids
    ``encode(decode(ids), add_special_tokens=False) == ids`` (specials included, since
    they decode to their text and are matched as added tokens). Encoding adds no bos.
    Text outside the vocabulary encodes as ``<unk>``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = special_token_ids(model_dir, vocab_size)
    names = {token_id: _SPECIAL_NAMES[role] for role, token_id in specials.items()}
    vocab = {names.get(i, token_text(i)): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names[specials["unk"]]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token=names[specials["bos"]],
        eos_token=names[specials["eos"]],
        pad_token=names[specials["pad"]],
        unk_token=names[specials["unk"]],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))


def vllm_executable() -> Path:
    """The ``vllm`` script of the running interpreter's environment."""
    return Path(sys.executable).parent / "vllm"


def cpu_serve_args(kv_cache_bytes: int, max_model_len: int = 1024) -> list[str]:
    """The CPU defaults of :class:`VllmServer`: float32 (batch-independent outputs),
    block 32, eager, prefix caching on, and an explicit engine KV-cache size."""
    return [
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--enable-prefix-caching",
    ]


class ServerError(RuntimeError):
    """The server exited, or did not become ready in time; the message ends with its log tail."""


class VllmServer:
    """One ``vllm serve`` subprocess; owns the process and its log file.

    ``args`` come after :func:`cpu_serve_args` (so a repeated flag overrides the
    default: argparse keeps the last one). The environment is this process's minus
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` (the API server needs a separate engine process),
    plus ``VLLM_CPU_OMP_THREADS_BIND=cores`` (pinned: vLLM's automatic binding
    reserves cores, differently with and without a connector), plus ``env``.
    ``stdout`` and ``stderr`` both go to ``log_path`` (truncated at launch).
    Not thread-safe; one launch per instance.
    """

    def __init__(
        self,
        model: Path | str,
        log_path: Path,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int = 1024,
        cores: str = "0",
        port: int | None = None,
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 20.0,
    ) -> None:
        self.model = str(model)
        self.log_path = log_path
        self.args = [*cpu_serve_args(kv_cache_bytes, max_model_len), *args]
        self.extra_env = dict(env or {})
        self.cores = cores
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None  # time.monotonic() at launch
        self.ended_at: float | None = None  # time.monotonic() when its exit was seen
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API root, ``<url>/v1``."""
        return f"{self.url}/v1"

    def command(self) -> list[str]:
        """The argv launched."""
        return [
            str(vllm_executable()),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]

    def environment(self) -> dict[str, str]:
        """The environment launched (see the class docstring)."""
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.cores
        env.update(self.extra_env)
        return env

    def launch(self) -> None:
        """Start the process (its own session, so its pid is its process group id) and
        return at once. Raises ``RuntimeError`` if already launched."""
        if self.proc is not None:
            raise RuntimeError("VllmServer: already launched")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )

    def start(self) -> VllmServer:
        """``launch()``, then wait until ``GET /health`` answers 200.

        Raises :class:`ServerError` (after stopping the process) if it exits first or
        is not ready within ``startup_timeout_s``; the message carries the log tail.
        """
        self.launch()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Poll ``/health`` until it answers 200, the process exits, or the deadline."""
        proc = self._proc()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerError(
                    f"vllm serve exited with status {proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self._healthy():
                return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"vllm serve not ready after {self.startup_timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)  # waiting for another process to start listening

    def wait_exit(self, timeout_s: float) -> int:
        """Wait for the process to exit by itself and return its status.

        Raises :class:`ServerError` (after stopping it) if it is still running after
        ``timeout_s``.
        """
        proc = self._proc()
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ServerError(
                f"vllm serve still running after {timeout_s:.0f} s; "
                f"log {self.log_path}:\n{self.log_tail()}"
            ) from None
        self._ended()
        return status

    def elapsed_s(self) -> float:
        """Seconds from launch to the exit (``wait_exit``/``stop``), or to now while it
        runs; 0 before launch."""
        if self.started_at is None:
            return 0.0
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return end - self.started_at

    def stop(self) -> int | None:
        """End the server: SIGTERM to its pid; after ``stop_grace_s``, SIGKILL to its
        process group. Leftover children in the group are killed too. Returns the exit
        status (None if never launched). Idempotent."""
        if self.proc is None:
            return None
        proc = self.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._ended()
        return proc.returncode

    def log_text(self) -> str:
        """The whole log so far ('' if none)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def get(self, path: str, timeout_s: float = 10.0) -> str:
        """``GET <url><path>``; returns the body. Raises ``urllib.error.URLError``/``OSError``."""
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as response:
            body: bytes = response.read()
        return body.decode()

    def __enter__(self) -> VllmServer:
        return self.start() if self.proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _proc(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise RuntimeError("VllmServer: not launched")
        return self.proc

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def _ended(self) -> None:
        """After the server's own exit: note the time (once), SIGKILL whatever is left
        in its process group (children that outlived it), close the log. Only the first
        call acts: the group id is not signalled again once the group may be gone."""
        if self.ended_at is not None:
            return
        self.ended_at = time.monotonic()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
