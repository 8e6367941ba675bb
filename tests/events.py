"""TensorBoard's own reader (EventAccumulator) over a run's event files: {tag: {step: value}}.
support.event_scalars calls scalars() in the test process (TensorBoard as it reads without TensorFlow) or runs
`python tests/events.py FILE...` (TensorBoard beside TensorFlow, whose import the test process must not take)."""
import json
import sys


def scalars(paths):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    found = {}
    for path in paths:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return found


if __name__ == "__main__":
    print(json.dumps(scalars(sys.argv[1:])))
