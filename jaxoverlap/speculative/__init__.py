"""Speculative decoding inside the overlap scheduler.

One speculative step is one jitted, donated program (step.py): the drafter's passes, the
target's verify pass over the window of 1 + k positions per request, acceptance, the
drafter's extend, and the relay writes. The host hands it only entry ids and new page
reservations (plus the drafts themselves for the host n-gram drafter), and reads the
accepted tokens one step late.

| file | job |
|---|---|
| spec_config.py | `SpecConfig`: the static description of the drafter (a jit static argument) |
| setup.py | builds the drafter (config, params, device-state layout) from the engine options |
| step.py | the jitted speculative decode step and the prefill step that also fills the drafter |
| verify.py | greedy acceptance and rejection sampling (via pallas_kernels.acceptance), draws, filters |
| eagle_head.py | the EAGLE head's decoder layer over its own paged cache |
| eagle.py | the EAGLE drafter: prefill, draft passes, draft extend |
| draft_model.py | the standalone draft model drafter |
| ngram_device.py | n-gram lookup against each request's own history on the device |
| ngram_index.py | the host-side n-gram trie (pure Python) |
| ngram_host.py | host drafts for a batch from the trie (the one path that waits for the device) |
"""
