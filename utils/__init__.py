"""What the lessons import: arguments (parse_args.py), logging (log.py) and data (data.py); the
course's plumbing around them (plumbing.py) is optional: utils/README.md.
"""


def course_output():
    """Course plumbing for the lessons that call it before importing their frameworks: a missing
    framework is one line, the libraries' noise filtered (utils/plumbing.py)."""
    from utils import plumbing  # noqa: F401  (importing it installs it)
