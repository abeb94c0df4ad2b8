"""The one error path of every ``hf-depth`` command.

An *expected* failure -- a bad recipe or override, bad or empty data, an unreadable, truncated or missing model
or checkpoint file -- is a :class:`UserError` (or one of the exceptions in :data:`EXPECTED`, which reading a user
file raises): ``hf-depth COMMAND`` prints it as one line, ``hf-depth COMMAND: <what is wrong and what to do>``,
and exits 2. Anything else is a bug: one line too, exit 1, and ``--debug`` (or ``HF_DEPTH_DEBUG=1``) shows the
traceback of either. Code that reads a user's file wraps the read in :func:`reading`, so the line names the file.
"""

from __future__ import annotations

import contextlib
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


def run_command(name: str, main, argv: list[str] | None = None) -> int:
    """Run a subcommand's ``main(argv)`` behind the one error path; returns the exit status."""
    global _debug_depth
    debug, argv = debug_requested(list(sys.argv[1:] if argv is None else argv))
    debug = debug or _debug_depth > 0  # a command run inside another (hf-depth train -> train.main) inherits it
    _debug_depth += debug
    try:
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
