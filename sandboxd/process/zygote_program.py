"""The program's side of a fork-server run (stdlib only, imported by the zygote at start-up):
run /sandbox/main.py as the interpreter runs a script (its recursion limit unchanged by the
zygote's frames below it), and exit as it does.

Loaded from the zygote's /sandbox next to `main.py` (the zygote); the program's process forgets
the module (it is not in a fresh interpreter's `sys.modules`) but keeps these functions.
"""

import atexit
import ctypes
import gc
import os
import signal
import sys


class RecursionCompensation:
    """Hide the zygote's own frames from the recursion limit.

    The program's module frame sits below this script's frames, so with the same limit it would
    hit RecursionError a few frames early. `sys.setrecursionlimit(limit + k)` gives the frames
    back; writing `limit` back into the limit the interpreter and the thread store keeps
    `sys.getrecursionlimit()` (and later `setrecursionlimit` calls) as in a fresh interpreter.
    The two fields are located by value (and verified) at start-up; when they cannot be found,
    nothing is changed.
    """

    def __init__(self):
        self.fields = []
        try:
            get_interp = ctypes.pythonapi.PyInterpreterState_Get
            get_interp.restype = ctypes.c_void_p
            get_tstate = ctypes.pythonapi.PyThreadState_Get
            get_tstate.restype = ctypes.c_void_p
            bases = [get_interp(), get_tstate()]
            original = sys.getrecursionlimit()
            sys.setrecursionlimit(48611)
            found = [self._find(base, 48611) for base in bases]
            sys.setrecursionlimit(48613)
            if all(f is not None and self._int(f).value == 48613 for f in found):
                self.fields = found
            sys.setrecursionlimit(original)
        except (AttributeError, OSError, ValueError):
            self.fields = []

    @staticmethod
    def _int(address):
        return ctypes.c_int.from_address(address)

    def _find(self, base, value):
        for offset in range(0, 4096, 4):
            if self._int(base + offset).value == value:
                return base + offset
        return None

    def apply(self, extra_frames):
        if not self.fields:
            return
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + extra_frames)
        for address in self.fields:
            self._int(address).value = limit


def _exit_status(exc):
    """What the interpreter exits with for an uncaught SystemExit (printing a non-int code)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        text = str(code)
    except Exception:
        text = ""
    _write_stderr(f"{text}\n")
    return 1


def _write_stderr(text):
    """As the interpreter writes its own messages: to sys.stderr, or to fd 2 when that is
    missing or None (a failure is ignored)."""
    try:
        stream = getattr(sys, "stderr", None)
        if stream is None:
            os.write(2, text.encode("utf-8", "backslashreplace"))
        else:
            stream.write(text)
    except Exception:
        pass


def _print_uncaught(exc, tb):
    """As the interpreter prints an uncaught exception: through `sys.excepthook`, and a hook
    that is missing or fails as the interpreter reports it (the hook's error escaped into the
    zygote's frames, with their traceback); a SystemExit from the hook is raised."""
    if not hasattr(sys, "excepthook"):
        _write_stderr("sys.excepthook is missing\n")
        sys.__excepthook__(type(exc), exc, tb)
        return
    try:
        sys.excepthook(type(exc), exc, tb)
    except SystemExit:
        raise
    except BaseException as error:
        _write_stderr("Error in sys.excepthook:\n")
        error_tb = error.__traceback__.tb_next  # without this frame
        sys.__excepthook__(type(error), error.with_traceback(error_tb), error_tb)
        _write_stderr("\nOriginal exception was:\n")
        sys.__excepthook__(type(exc), exc, tb)


def _clear_module_dict(namespace):
    """As the interpreter clears a module at exit: `_names` first, then the rest."""
    for pass_ in (1, 2):
        for name in list(namespace):
            if name == "__builtins__":
                continue
            if pass_ == 2 or (name.startswith("_") and not name.startswith("__")):
                namespace[name] = None


def _exit(status, main, interrupted=False):
    """The interpreter's exit, minus the teardown of the zygote's own heap (every object freed
    would copy its page from the zygote: ~10 ms). Threads are joined, atexit handlers run,
    `__main__` is cleared (finalizers run) and garbage collected, stdio flushed."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException as exc:
            _report_unraisable(exc, threading, exc.__traceback__.tb_next)
    atexit._run_exitfuncs()
    sys.last_type = sys.last_value = sys.last_traceback = None  # as python3 clears them
    if sys.version_info >= (3, 12):
        sys.last_exc = None
    _clear_module_dict(main.__dict__)
    gc.collect()
    if not _flush_std_files():
        status = 120
    if interrupted:  # as the interpreter does after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT  # PID 1 of its namespace ignores its own SIGINT
    os._exit(status)


class _FailsWhenFreed:
    def __del__(self):
        raise RuntimeError("a report made to learn the hook's argument type")


def _unraisable_args_type():
    """`sys.__unraisablehook__` takes nothing but the interpreter's own argument type (any other
    object was a TypeError, with a traceback of the zygote's), which is not exposed: it is
    taken from one report, made here in the zygote."""
    reports, hook = [], sys.unraisablehook
    sys.unraisablehook = reports.append
    _FailsWhenFreed()
    sys.unraisablehook = hook
    return type(reports[0])


UNRAISABLE_ARGS = _unraisable_args_type()


def _report_unraisable(exc, obj, traceback):
    """As the interpreter reports an error it cannot raise: "Exception ignored in: <obj>"."""
    try:
        sys.unraisablehook(UNRAISABLE_ARGS((type(exc), exc, traceback, None, obj)))
    except Exception:
        pass


def _flush_std_files():
    """As the interpreter flushes stdio at exit: a stream that is missing, None or closed is
    skipped (a program that closed its stdout exited 120, and one that deleted it printed a
    traceback of the zygote's); a failed flush is reported as unraisable for stdout, silently
    for stderr. False when either failed (the exit status is then 120)."""
    flushed = True
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is None or _is_closed(stream):
            continue
        try:
            stream.flush()
        except Exception as exc:
            flushed = False
            if name == "stdout":  # its traceback without this frame, as the interpreter's
                _report_unraisable(exc, stream, exc.__traceback__.tb_next)
    return flushed


def _is_closed(stream):
    try:
        return bool(stream.closed)
    except Exception:
        return False


def as_the_file_tokenizer_reads(source):
    """The source a python < 3.12 interpreter reads from a script file: it reads the file line
    by line as C strings, so a NUL byte ends its line there and the rest of that line (its
    newline too: \\n, \\r\\n or \\r) is never seen; the next line joins on. compile() would refuse
    the bytes whole (ValueError) where `python3 main.py` runs them or gives a SyntaxError."""
    if sys.version_info >= (3, 12) or b"\0" not in source:
        return source  # 3.12+ compile() raises the same SyntaxError as the interpreter
    kept = []
    start = 0
    while True:
        nul = source.find(b"\0", start)
        if nul < 0:
            kept.append(source[start:])
            return b"".join(kept)
        kept.append(source[start:nul])
        ends = [i for i in (source.find(b"\n", nul), source.find(b"\r", nul)) if i >= 0]
        if not ends:
            return b"".join(kept)
        start = min(ends) + 1
        if source[start - 1 : start + 1] == b"\r\n":
            start += 1


def run(main, path, recursion):
    """Run the program as the interpreter runs a script; never returns."""
    try:
        with open(path, "rb") as source:
            text = as_the_file_tokenizer_reads(source.read())
            code = compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as exc:  # printed without a traceback, as for a script
        sys.excepthook(type(exc), exc.with_traceback(None), None)
        _exit(1, main)
    recursion.apply(3)  # this module's, _run's and exec's frames sit below the program's
    try:
        exec(code, main.__dict__)
    except BaseException as exc:
        uncaught = exc  # ended with below, where no exception is being handled (as in python3)
    else:
        _exit(0, main)
    if isinstance(uncaught, SystemExit):
        status = _exit_status(uncaught)
        del uncaught  # what only its frames held is freed before atexit, as in python3
        _exit(status, main)
    tb = uncaught.__traceback__.tb_next if uncaught.__traceback__ else None
    # kept, as python3 keeps them, for the hook and atexit (the exit clears them)
    sys.last_type, sys.last_value, sys.last_traceback = type(uncaught), uncaught, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = uncaught
    status = None
    try:  # printed as the interpreter prints it
        _print_uncaught(uncaught.with_traceback(tb), tb)
    except SystemExit as hook_exit:  # the interpreter exits with it too
        status = _exit_status(hook_exit)
    interrupted = status is None and isinstance(uncaught, KeyboardInterrupt)
    del uncaught, tb
    _exit(1 if status is None else status, main, interrupted)
