"""What every static check ends with: its problems, one a line, then its summary line; the
exit status 1 where there is a problem."""


def finish(problems, summary):
    for p in problems:
        print(p)
    print(summary)
    return 1 if problems else 0
