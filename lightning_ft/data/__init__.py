"""Which samples each replica group reads, and where a restarted or healed group goes on reading.

* :mod:`.position`: a group's position in its own shard (epoch, batch index), carried by a heal.
* :mod:`.placement`: ``data_mode="exactly_once"``: each committed step reads the next samples of one permutation.
* :mod:`.sidecars`: each rank's own data-loader state beside a shared checkpoint.
"""
