"""The command lines of cluster's node programs, read the one way they all use, and the one
way they answer (record, answer).

Standard library only, Python 3.8+. Not argparse: importing it (with the gettext lookups of
its messages) and building a parser cost a node several milliseconds per program, in every
process of a launch, for arguments only cluster's launcher writes.
"""
import json
import sys
import types

RECORD_START, RECORD_END = b"\x1e", b"\x1f"     # ASCII record / unit separators (nodes.Demux)


def parse(prog, argv, options=None, flags=(), positional=(), required=()):
    """argv's positional words (named by `positional`, in order), `--NAME VALUE` options and
    `--FLAG` switches, as attributes (dashes made underscores). options maps each name to
    its default, whose type a value is converted to (int, float), or to a type (int, float,
    str) for an option without a default (None). Anything else ends the program with a
    message naming prog, as does a missing positional word or required option."""
    options = options or {}
    values = {name: (None if isinstance(d, type) else d) for name, d in options.items()}
    values.update({name: False for name in flags})
    words: list[str] = []     # (not evaluated: a local annotation, Python 3.8 too)
    it = iter(argv)
    for word in it:
        name = word[2:] if word.startswith("--") else None
        if name in flags:
            values[name] = True
        elif name in options:
            value = next(it, None)
            if value is None:
                raise SystemExit("%s: %s needs a value" % (prog, word))
            values[name] = convert(prog, word, value, options[name])
        elif name is None and len(words) < len(positional):
            words.append(word)
        else:
            raise SystemExit("%s: unknown argument %s" % (prog, word))
    if len(words) < len(positional):
        raise SystemExit("%s: %s is required" % (prog, positional[len(words)]))
    missing = [name for name in required if values.get(name) is None]
    if missing:
        raise SystemExit("%s: --%s is required" % (prog, missing[0]))
    values.update(zip(positional, words))
    return types.SimpleNamespace(**{name.replace("-", "_"): v for name, v in values.items()})


def convert(prog, word, value, default):
    kind = default if isinstance(default, type) else type(default)
    if kind not in (int, float):
        return value
    try:
        return kind(value)
    except ValueError:
        raise SystemExit("%s: %s takes a number, not %r" % (prog, word, value))


# A node program's answer is framed, RS, a JSON object, US, as the supervisor's records among the
# job's output are (supervisor.Out), and read by the launcher one way (nodes.read_answers): what a
# node's shell prints before the program starts (a greeting in ~/.bashrc, a setup line's
# output), even a line that is itself a JSON object, is never taken for the answer.
def record(obj):
    # json.dumps escapes every control character: the body holds no RS or US
    return RECORD_START + json.dumps(obj).encode() + RECORD_END


def answer(obj):
    """obj, framed, on standard output (a line of its own, for a person who reads it)."""
    sys.stdout.flush()
    sys.stdout.buffer.write(record(obj) + b"\n")
    sys.stdout.buffer.flush()
