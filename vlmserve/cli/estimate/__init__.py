"""`vlmserve estimate`: the reference article's labs, capacity and NanoFlow schedules."""
