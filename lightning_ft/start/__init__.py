"""Where a replica group starts from: the job's durable record, and the decision taken before the first quorum.

* :mod:`.record`: the record kept beside the checkpoints (the committed step of each file, the job's end).
* :mod:`.decision`: wait for a coherent start, resume from the newest checkpoint when no live peer is ahead of it,
  exit when the job already finished.
"""
