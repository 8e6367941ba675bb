"""The course's plumbing: what no lesson teaches, around the lessons (course/README.md). A lesson
brings it in with one visible, optional import (`from course import plumbing`) and runs the same
without it, as a copy in another project does."""
