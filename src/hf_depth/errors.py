"""The one error path of every ``hf-depth`` command.

An *expected* failure -- a bad recipe or override, bad or empty data, an unreadable, truncated or missing model
or checkpoint file -- is a :class:`UserError` (or one of the exceptions in :data:`EXPECTED`, which reading a user
file raises): ``hf-depth COMMAND`` prints it as one line, ``hf-depth COMMAND: <what is wrong and what to do>``,
and exits 2. Anything else is a bug: one line too, exit 1, and ``--debug`` (or ``HF_DEPTH_DEBUG=1``) shows the
traceback of either. Code that reads a user's file wraps the read in :func:`reading`, so the line names the file.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pickle
import sys
import traceback
import zipfile

DEBUG_ENV = "HF_DEPTH_DEBUG"
_debug_depth = 0


class UserError(ValueError):
    """An expected failure caused by the user's input: printed as one line, exit status 2."""


def _expected_types() -> tuple[type, ...]:
    types: list[type] = [ValueError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile]
    with contextlib.suppress(ImportError):
        import yaml

        types.append(yaml.YAMLError)
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        types.append(SafetensorError)
    return tuple(types)


def is_expected(exc: BaseException) -> bool:
    """Whether ``exc`` is a user-input failure (exit 2) rather than a bug (exit 1)."""
    if isinstance(exc, KeyError):  # a missing dict key is a bug unless a reader turned it into a UserError
        return False
    return isinstance(exc, _expected_types())


def one_line(exc: BaseException) -> str:
    """The exception as a single line (multi-line messages joined with ' | ')."""
    text = str(exc).strip() or type(exc).__name__
    if not isinstance(exc, UserError) and type(exc).__name__ not in text and not isinstance(exc, ValueError):
        text = f"{type(exc).__name__}: {text}"
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """(``--debug`` given or ``HF_DEPTH_DEBUG`` set, argv without ``--debug``)."""
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return env or "--debug" in argv, [a for a in argv if a != "--debug"]


@contextlib.contextmanager
def usage_errors_are_user_errors(name: str):
    """While a command runs, an argparse usage error (a missing argument, ``--seq-len 0`` refused by
    :func:`arg_number`) is a :class:`UserError`: one line and exit 2 like every other bad input, instead of the usage
    block plus ``SystemExit`` (which in-process callers would have to catch)."""
    original = argparse.ArgumentParser.error

    def error(parser, message):
        raise UserError(f"{message} (see `hf-depth {name} --help`)")

    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def run_command(name: str, main, argv: list[str] | None = None) -> int:
    """Run a subcommand's ``main(argv)`` behind the one error path; returns the exit status."""
    global _debug_depth
    debug, argv = debug_requested(list(sys.argv[1:] if argv is None else argv))
    debug = debug or _debug_depth > 0  # a command run inside another (hf-depth train -> train.main) inherits it
    _debug_depth += debug
    try:
        with usage_errors_are_user_errors(name):
            return int(main(argv) or 0)
    except KeyboardInterrupt:
        print(f"hf-depth {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        expected = is_expected(e)
        if debug:
            traceback.print_exc()
        elif expected:
            print(f"hf-depth {name}: {one_line(e)}", file=sys.stderr)
        else:
            print(f"hf-depth {name}: internal error: {one_line(e)} (rerun with --debug or {DEBUG_ENV}=1 for the "
                  "traceback, and please report it)", file=sys.stderr)
        return 2 if expected else 1
    finally:
        _debug_depth -= debug


def command(name: str, body, doc: str):
    """The ``main(argv)`` of subcommand ``hf-depth NAME``: ``body(argv)`` run behind :func:`run_command`;
    ``doc`` says its exit statuses."""

    def main(argv: list[str] | None = None) -> int:
        return run_command(name, body, argv)

    main.__doc__ = f"``hf-depth {name}``: {doc}"
    return main


def command_parser(name: str, module_doc: str, **kwargs) -> argparse.ArgumentParser:
    """The argument parser of ``hf-depth NAME``, described by the first paragraph of its module's docstring."""
    return argparse.ArgumentParser(prog=f"hf-depth {name}", description=module_doc.split("\n\n")[0], **kwargs)


@contextlib.contextmanager
def reading(path, what: str = "file", hint: str | None = None):
    """Turn any failure while reading the user's ``path`` into a :class:`UserError` naming it.

    ``with reading(args.model, "model folder"): model = AutoModelForCausalLM.from_pretrained(args.model)``
    """
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if isinstance(e, ValueError) and str(path) in str(e):
            raise  # already names the file (and says what is allowed)
        # inside a read, a missing key or a wrong type comes from the file's contents, not from our code
        if not (is_expected(e) or isinstance(e, (RuntimeError, StopIteration, LookupError, TypeError, AttributeError))):
            raise
        detail = "no data (empty)" if isinstance(e, StopIteration) else one_line(e)
        if len(detail) > 300:
            detail = detail[:300] + "..."
        raise UserError(f"cannot read {what} {str(path)!r}: {detail}; "
                        f"{hint or 'check that it is complete and of the right kind (a truncated or partial file: re-save or re-download it)'}") from e


MODEL_HINT = ("give a save_pretrained folder (config.json + model.safetensors) or a run folder; a truncated "
              "or partial file: re-save or re-download it")


def reading_model(path):
    """``with reading_model(path): AutoModelForCausalLM.from_pretrained(path)``: failures name the model folder."""
    return reading(path, "the model", MODEL_HINT)


# ---------------------------------------------------------------------------------------------- structured files
def read_text(path, what: str = "file") -> str:
    """The UTF-8 text of the user's file ``path``; a missing file, a folder or binary bytes is a :class:`UserError`
    naming it."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise UserError(f"{str(p)!r} is a folder, not a {what}: give the file itself")
    with reading(p, what, "give an existing UTF-8 text file"):
        try:
            return p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{str(p)!r}: not a text {what} (byte {e.start} is not UTF-8: binary or corrupted); "
                            "give the right file") from None


def _kind_check(path, value, expect, what: str):
    if expect is not None and not isinstance(value, expect):
        want = {dict: "a mapping ({...})", list: "a list ([...])"}.get(expect, getattr(expect, "__name__", str(expect)))
        raise UserError(f"{str(path)!r}: a {what} must hold {want} at the top level, got {type(value).__name__}")
    return value


def read_json(path, what: str = "JSON file", expect: type | None = dict):
    """``json.load`` of the user's file: malformed, empty or of the wrong top-level kind (``expect``) is a
    :class:`UserError` naming the file and the line, e.g. ``'x/summary.json': not valid JSON (line 3, column 2:
    Expecting ',' delimiter); fix or delete the file``."""
    import json

    text = read_text(path, what)
    if not text.strip():
        raise UserError(f"{str(path)!r}: the {what} is empty (not valid JSON); fix or delete the file")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{str(path)!r}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                        "fix or delete the file") from None
    return _kind_check(path, value, expect, what)


def yaml_load(text: str):
    """``yaml.safe_load`` that refuses a repeated mapping key (PyYAML silently keeps the last one, so a recipe with
    two ``model:`` sections would train the second): a ``yaml.YAMLError`` with the line of the repeat."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (str, int, float, bool)):
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def read_yaml(path, what: str = "YAML file", expect: type | None = dict, empty=None):
    """``yaml.safe_load`` of the user's file (``empty`` for an empty one); malformed or of the wrong top-level kind
    is a :class:`UserError` naming the file and the line."""
    import yaml

    text = read_text(path, what)
    try:
        value = yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise UserError(f"{str(path)!r}: not valid YAML ({where}{getattr(e, 'problem', None) or type(e).__name__}); "
                        "fix the syntax") from None
    if value is None:
        return empty
    return _kind_check(path, value, expect, what)


def read_jsonl(path, what: str = "JSON-lines file") -> list[dict]:
    """The rows of the user's JSON-lines file (blank lines skipped); a line that is not a JSON object is a
    :class:`UserError` naming the file and the line."""
    import json

    rows = []
    for i, line in enumerate(read_text(path, what).splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{str(path)!r}: line {i + 1} is not valid JSON ({e.msg}, column {e.colno}): "
                            f"{line[:60]!r}; fix or delete the line") from None
        if not isinstance(row, dict):
            raise UserError(f"{str(path)!r}: line {i + 1} must be a JSON object ({{...}}), got {type(row).__name__}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- command-line numbers
def arg_number(kind: type = int, minimum: float = 1, strict: bool = False, maximum: float | None = None):
    """An argparse ``type=``: a finite ``kind`` (int or float) ``>= minimum`` (``> minimum`` when ``strict``) and
    ``<= maximum``. A bad value is argparse's one-line error naming the flag, exit 2:
    ``ap.add_argument("--seq-len", type=arg_number(int, 2))`` -> ``argument --seq-len: must be an integer >= 2, got '0'``.
    """
    noun = "an integer" if kind is int else "a finite number"
    bound = f"{'>' if strict else '>='} {minimum:g}" + (f" and <= {maximum:g}" if maximum is not None else "")

    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            value = None
        if (value is None or not math.isfinite(value) or (value <= minimum if strict else value < minimum)
                or (maximum is not None and value > maximum)):
            raise argparse.ArgumentTypeError(f"must be {noun} {bound}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def replaceable_output(out, flag: str = "--out", protect=()) -> None:
    """Refuse an output folder a command would replace (``rmtree`` then rename) when that would destroy something
    else: a file, a non-empty folder that is not an earlier output (no ``config.json``), or a folder holding one of
    ``protect`` (the run or checkpoint being read)."""
    from pathlib import Path

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"`{flag}` {str(out)!r} is a file: give a folder (it is replaced by the output)")
    for keep in protect:
        keep = Path(keep).resolve()
        if out.resolve() == keep or out.resolve() in keep.parents:
            raise UserError(f"`{flag}` {str(out)!r} holds the input {str(keep)!r}: give a folder outside it")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").exists():
        raise UserError(f"`{flag}` {str(out)!r} is a non-empty folder that is not an earlier output (no config.json): "
                        "give a new or empty folder")
