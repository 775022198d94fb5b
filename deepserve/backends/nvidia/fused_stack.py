"""The NVIDIA backend's run of a V4 decoder stack (`FusedOps.decoder_stack`): the model's own layer order, with
each mHC site's mix started by the kernel that ends the site before it.

An mHC site opens with a mix: every token's n streams times the site's `fn` weights ([(2 + n) n, n D], a GEMV per
token that reads all of the streams). The site before it has just written those streams (`hc_post`), so its
kernel can form the mix's partial sums while the rows are still in registers (`hc_post_mix`); the next site's
`hc_pre_norm` then reads the sums instead of the streams: one launch of 4.6 us where post and mix took 1.7 + 3.3
and a gap, at V4-Flash's shapes (run 38, bench/investigations/gpu_notes.md). The partial sums
cross layer boundaries, so the model's per-layer forward cannot carry them: this module runs the stack instead,
calling the layers' attention and MoE as they are and their mHC parameters through this backend's ops. The final
head takes the last layer's sums only where every row is a logits row (a static decode step), as the model's own
`final_hidden` would read the same rows.
"""

from __future__ import annotations


def run_decoder_stack(backend, body, batch, layout, logits_rows):
    """(last streams, final hidden): `DeepseekV4Body.forward` then `final_hidden` of `logits_rows` (None: every
    row in order), the mixes handed from site to site."""
    cfg, token_ids = body.cfg, batch.token_ids
    head, layers = body.hc_head, body.layers
    streams, mix = body.embed(token_ids), None
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            following = layers[i + 1].attn_hc.fn
        else:  # the head: only where it reads these rows as they are
            following = head.hc_fn if logits_rows is None else None
        x, post, comb = _pre_norm(backend, cfg, layer.attn_hc, streams, layer.input_layernorm.weight, mix)
        streams, mix = backend.hc_post_mix(streams, layer.self_attn(x, layout.layer(i)), post, comb, layer.ffn_hc.fn)
        x, post, comb = _pre_norm(backend, cfg, layer.ffn_hc, streams, layer.post_attention_layernorm.weight, mix)
        f = layer.mlp(x, token_ids)
        if following is None:
            streams, mix = backend.hc_post(streams, f, post, comb), None
        else:
            streams, mix = backend.hc_post_mix(streams, f, post, comb, following)
    if logits_rows is not None:
        return streams, body.final_hidden(streams[logits_rows])
    hidden = backend.hc_head_norm(streams, head.hc_fn, head.hc_base, head.hc_scale, cfg.hc_eps, cfg.rms_norm_eps,
                                  body.norm.weight, cfg.rms_norm_eps, mix=mix)
    return streams, hidden


def _pre_norm(backend, cfg, site, streams, weight, mix):
    return backend.hc_pre_norm(streams, site.fn, site.base, site.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                               cfg.rms_norm_eps, weight, cfg.rms_norm_eps, mix=mix)
