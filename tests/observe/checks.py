"""What the observe checkers share: failures are collected, printed, and decide the exit status."""

failures = []


def fail(message):
    failures.append(message)
    print("FAIL:", message)


def status():
    """The exit status: 1 if anything failed, else 0."""
    return 1 if failures else 0
