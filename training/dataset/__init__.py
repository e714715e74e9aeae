"""The converted dataset as training reads it, one responsibility per module, no import cycle:

    format   the packed format shared with conversion (manifest, blocks, feature layout, codecs, TFRecord)
    order    the epoch plan: which samples each rank reads, in order, from any position
    reader   decoding blocks and whole splits (numpy; evaluation and the cache warm-up use it)
    loader   the torch DataLoader over a rank's epoch (the only module importing torch)

Nothing is re-exported here: importing the package must not import torch for the modules that need
only the format or the plan (the cache warm-up runs in the orchestrator's worker).
"""
