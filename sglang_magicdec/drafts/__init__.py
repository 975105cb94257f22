"""Draft KV selections: which committed KV slots the draft attends to.

Each draft is a small policy dataclass with one selecting method (`StreamingDraft.select`,
`SnapKVDraft.select_layer`) and a *selection* that applies it inside the server and answers the
worker's one question, once per round and request: `positions(...)`, the committed positions the
draft reads (`DraftPositions`: SnapKV's per-layer, per-KV-head summary positions, already on the
device, then ranges every layer and head reads), which the round resolves into pool slots through
the request's own `req_to_token` row. The selection also owns whatever state the policy keeps
across requests (SnapKV's shared summaries) and hears about prefill forwards and released KV.

The policies are in `streaming` and `snapkv`; `selection.make_selection` builds the one
`--magicdec-draft` names. (Nothing is imported here: the modules import each other, never their
package.)
"""
