"""What makes a chunk the one a request needs: the model, its weights, its bytes.

- :mod:`.model`: the namespace of a model configuration (decision 0005);
- :mod:`.namespace_record`: the record a lower tier keeps of each namespace;
- :mod:`.content_digest`: whole-file digests of weights files, cached by stat;
- :mod:`.weight_files`: which files of a model directory the engine loads weights from;
- :mod:`.weights`: the weights' state as the scheduler half knows it (decision 0019).

Pure Python: no torch, no vLLM.
"""
