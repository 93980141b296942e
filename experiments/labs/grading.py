"""What the labs' self-checks share.  A wrong answer is shown with the student's
figure only, never the expected one: the check says which answer to rework, not
what it should be."""
import importlib.util


def load_student(path, name):
    """The student's file at `path`, run as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def close(got, want):
    """Whether the answer is a number within 1 % of the formula's."""
    return isinstance(got, (int, float)) and abs(got - want) <= 0.01 * max(abs(want), 1e-12)


def grade(checks, wrong_shown=None):
    """Print `ok` or `WRONG` and the student's figure for each (name, yours, expected)
    of `checks`: tuples must be equal, numbers `close`.  With wrong_shown, only the
    first that many wrong answers are printed.  Returns (wrong, total)."""
    wrong = total = 0
    for name, got, want in checks:
        ok = got == want if isinstance(want, tuple) else close(got, want)
        total += 1
        wrong += not ok
        if wrong_shown is None or (not ok and wrong <= wrong_shown):
            print(f"{'ok   ' if ok else 'WRONG'} {name}: yours {'missing' if got is None else got}")
    return wrong, total
