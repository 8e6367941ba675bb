"""What the lessons import: arguments (parse_args.py), logging (log.py), data (data.py). Around
them, optional: the course's plumbing (plumbing.py; utils/README.md)."""


def course_output():  # course plumbing, for the lessons that call it before their frameworks
    from utils import plumbing  # noqa: F401  (importing it installs it)
