"""What the lessons import: arguments (parse_args.py), logging (log.py), data (data.py). Around
them, optional: the course's plumbing (plumbing.py; utils/README.md)."""
