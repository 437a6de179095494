//! Per-slot state layout (`rounds.md` section 3): GDN recurrent and conv state, attention K/V, QSA raw and pooled
//! keys, PLE history and conv tail, and the MTP layer's caches, sized for a context length.

use flashplan_plan::{
    ElemType, LayerKind, ModelConfig, StateKind, StateLayout, StatePiece, STATE_ALIGN,
};

const ALIGN: u64 = 256;

/// Builds the state layout for `slots` slots of `context` tokens.
pub fn build_state(cfg: &ModelConfig, context: u64, slots: u32) -> StateLayout {
    let mut pieces: Vec<StatePiece> = Vec::new();
    let mut add =
        |name: String, kind: StateKind, layer: Option<u32>, shape: Vec<u64>, elem: ElemType| {
            pieces.push(StatePiece {
                name,
                kind,
                layer,
                shape,
                elem,
                offset: 0,
                byte_offset: 0,
            });
        };
    let ratio = cfg.indexer_compress_ratio as u64;
    let attn =
        |prefix: &str,
         layer: Option<u32>,
         add: &mut dyn FnMut(String, StateKind, Option<u32>, Vec<u64>, ElemType)| {
            let kvh = cfg.num_key_value_heads as u64;
            let hd = cfg.head_dim as u64;
            let id = cfg.indexer_head_dim as u64;
            add(
                format!("{prefix}.k_cache"),
                StateKind::KCache,
                layer,
                vec![context, kvh, hd],
                ElemType::Bf16,
            );
            add(
                format!("{prefix}.v_cache"),
                StateKind::VCache,
                layer,
                vec![context, kvh, hd],
                ElemType::Bf16,
            );
            add(
                format!("{prefix}.indexer_raw_keys"),
                StateKind::IndexerRawKeys,
                layer,
                vec![context, id],
                ElemType::Bf16,
            );
            add(
                format!("{prefix}.indexer_pooled"),
                StateKind::IndexerPooled,
                layer,
                vec![context / ratio, id],
                ElemType::Bf16,
            );
        };
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        let l = Some(i as u32);
        if cfg.ple_layer_ids.contains(&(i as u32 + 1)) {
            add(
                format!("layers.{i}.ple.history"),
                StateKind::PleHistory,
                l,
                vec![cfg.ngram_size as u64 - 1],
                ElemType::U32,
            );
            add(
                format!("layers.{i}.ple.tail"),
                StateKind::PleTail,
                l,
                vec![cfg.ple_tail() as u64, cfg.hc_width() as u64],
                ElemType::F32,
            );
        }
        match kind {
            LayerKind::Gdn => {
                add(
                    format!("layers.{i}.gdn.recurrent"),
                    StateKind::GdnRecurrent,
                    l,
                    vec![
                        cfg.linear_num_value_heads as u64,
                        cfg.linear_key_head_dim as u64,
                        cfg.linear_value_head_dim as u64,
                    ],
                    ElemType::F32,
                );
                add(
                    format!("layers.{i}.gdn.conv"),
                    StateKind::GdnConv,
                    l,
                    vec![
                        cfg.linear_conv_kernel_dim as u64 - 1,
                        cfg.gdn_conv_dim() as u64,
                    ],
                    ElemType::F32,
                );
            }
            LayerKind::Attention => attn(&format!("layers.{i}.attn"), l, &mut add),
        }
    }
    if cfg.mtp.is_some() {
        attn("mtp.attn", None, &mut add);
    }
    let mut elems = 0;
    let mut bytes = 0;
    for p in &mut pieces {
        p.offset = elems;
        p.byte_offset = bytes;
        elems = (elems + p.elems()).div_ceil(STATE_ALIGN) * STATE_ALIGN;
        bytes = (bytes + p.elems() * p.elem.size()).div_ceil(ALIGN) * ALIGN;
    }
    StateLayout {
        context,
        slots,
        slot_elems: elems,
        slot_bytes: bytes,
        pieces,
    }
}
