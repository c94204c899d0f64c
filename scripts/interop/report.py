"""One result line per checked client path, collected by run.sh into the results table:
`RESULT<TAB>client<TAB>path<TAB>ok|FAIL: why`."""

import traceback


def result(client, path, ok, detail=""):
    status = "ok" if ok else "FAIL: " + " ".join(str(detail).split())[:300]
    print(f"RESULT\t{client}\t{path}\t{status}", flush=True)
    return ok


def attempt(client, path, fn):
    """Runs `fn()`; its return value (truthy, or a (bool, detail) pair) or exception is the result."""
    try:
        r = fn()
    except BaseException as e:  # a client's SystemExit / assert counts as a failure too
        traceback.print_exc()
        return result(client, path, False, f"{type(e).__name__}: {e}")
    if isinstance(r, tuple):
        return result(client, path, bool(r[0]), r[1])
    return result(client, path, bool(r), "check returned false")
