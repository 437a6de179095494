//! Why a safetensors file does not parse, in words that name the tensor. The `safetensors` crate refuses a header
//! whose offsets disagree with a tensor's dtype and shape, or run past the file, with one message for every such
//! case ("invalid shape, data type, or offset for tensor"); [`explain`] reads the header again and says which
//! tensor and what it expected. Format: an 8-byte little-endian header length, the JSON header (per tensor `dtype`,
//! `shape`, `data_offsets` [begin, end) into the data after the header; `__metadata__` aside), then the data, which
//! the tensors must cover exactly (the crate's `validate`, which checks them in the order of their offsets).

use safetensors::Dtype;
use serde_json::Value;

/// What is wrong with the safetensors file `bytes`, naming the first tensor at fault in the order the crate checks
/// them (by data offsets); `None` when this reading finds nothing (a header that is not a JSON object of
/// well-typed entries, say: the crate's own message then stands alone).
pub(crate) fn explain(bytes: &[u8]) -> Option<String> {
    let len_bytes: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    let n = u64::from_le_bytes(len_bytes);
    let total = bytes.len() as u64;
    let data_start = match 8u64.checked_add(n) {
        Some(s) if s <= total => s,
        _ => {
            return Some(format!(
                "its header claims {n} bytes, past the {} bytes after its 8-byte length",
                total - 8
            ))
        }
    };
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..data_start as usize]).ok()?;
    let data = total - data_start;
    // (begin, end, name, dtype, shape) of every tensor, in the crate's order.
    let mut tensors = Vec::new();
    for (name, v) in &header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v.get("dtype")?.as_str()?;
        let shape: Vec<u64> = v
            .get("shape")?
            .as_array()?
            .iter()
            .map(Value::as_u64)
            .collect::<Option<_>>()?;
        let offsets = v.get("data_offsets")?.as_array()?;
        let (begin, end) = (offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?);
        tensors.push((begin, end, name, dtype, shape));
    }
    tensors.sort();
    let mut at = 0;
    for (begin, end, name, dtype_name, shape) in &tensors {
        if *begin != at {
            return Some(format!(
                "tensor {name}: its data_offsets begin at byte {begin} of the data, where the tensors before it end \
                 at {at} (a gap or an overlap)"
            ));
        }
        let Ok(dtype) = serde_json::from_value::<Dtype>(Value::from(*dtype_name)) else {
            return Some(format!("tensor {name}: unknown dtype {dtype_name}"));
        };
        let bits = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|numel| numel.checked_mul(dtype.bitsize() as u64));
        let need = match bits {
            Some(b) if b % 8 == 0 => b / 8,
            _ => {
                return Some(format!(
                    "tensor {name}: dtype {dtype_name} x shape {shape:?} is not a whole number of bytes that fits \
                     64 bits"
                ))
            }
        };
        if *end < *begin || end - begin != need {
            return Some(format!(
                "tensor {name}: dtype {dtype_name} x shape {shape:?} needs {need} bytes, its data_offsets \
                 [{begin}, {end}] give {}",
                *end as i128 - *begin as i128
            ));
        }
        at = *end;
    }
    if at > data {
        // The tensor the data ends inside (or before), and how many lie past the end.
        let past = tensors.iter().filter(|t| t.1 > data).count();
        let (_, end, name, _, _) = tensors.iter().find(|t| t.1 > data)?;
        return Some(format!(
            "tensor {name}: its data_offsets end at byte {end} of the data, past the {data} bytes the file holds \
             after its header (truncated? {past} {} past that point)",
            if past == 1 { "tensor lies" } else { "tensors lie" }
        ));
    }
    (at < data).then(|| {
        format!(
            "the tensors cover {at} bytes of data, and the file holds {data} after its header (bytes past the last \
             tensor)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of `header` (JSON) and `data` bytes of data.
    fn file(header: &Value, data: usize) -> Vec<u8> {
        let h = header.to_string();
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h.as_bytes());
        b.resize(b.len() + data, 0);
        b
    }

    fn two(a: &Value, b: &Value) -> Value {
        serde_json::json!({"__metadata__": {"format": "pt"}, "a": a, "b": b})
    }

    #[test]
    fn a_sound_file_has_nothing_to_explain_and_the_crate_agrees() {
        let h = two(
            &serde_json::json!({"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}),
            &serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}),
        );
        let f = file(&h, 20);
        assert!(safetensors::SafeTensors::deserialize(&f).is_ok());
        assert_eq!(explain(&f), None);
    }

    #[test]
    fn each_fault_names_its_tensor_and_what_was_expected() {
        let ok_a = serde_json::json!({"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]});
        for (h, data, says) in [
            // F32 where the offsets hold BF16.
            (
                two(
                    &serde_json::json!({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 12]}),
                    &serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}),
                ),
                20,
                "tensor a: dtype F32 x shape [2, 3] needs 24 bytes, its data_offsets [0, 12] give 12",
            ),
            // A shape of another size.
            (
                two(
                    &ok_a,
                    &serde_json::json!({"dtype": "F32", "shape": [3], "data_offsets": [12, 20]}),
                ),
                20,
                "tensor b: dtype F32 x shape [3] needs 12 bytes, its data_offsets [12, 20] give 8",
            ),
            // Offsets past the data.
            (
                two(
                    &ok_a,
                    &serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}),
                ),
                16,
                "tensor b: its data_offsets end at byte 20 of the data, past the 16 bytes the file holds after its \
                 header (truncated? 1 tensor lies past that point)",
            ),
            // A gap between the tensors.
            (
                two(
                    &ok_a,
                    &serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}),
                ),
                24,
                "tensor b: its data_offsets begin at byte 16 of the data, where the tensors before it end at 12 (a \
                 gap or an overlap)",
            ),
            // Bytes past the last tensor.
            (
                two(
                    &ok_a,
                    &serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}),
                ),
                24,
                "the tensors cover 20 bytes of data, and the file holds 24 after its header (bytes past the last \
                 tensor)",
            ),
        ] {
            let f = file(&h, data);
            // The crate refuses each; this reading says why.
            assert!(
                safetensors::SafeTensors::deserialize(&f).is_err(),
                "{says}"
            );
            assert_eq!(explain(&f).as_deref(), Some(says));
        }
        // A header longer than the file.
        let mut f = file(&two(&ok_a, &ok_a), 12);
        f.truncate(20);
        assert!(safetensors::SafeTensors::deserialize(&f).is_err());
        assert_eq!(
            explain(&f).as_deref(),
            Some(
                format!(
                    "its header claims {} bytes, past the 12 bytes after its 8-byte length",
                    two(&ok_a, &ok_a).to_string().len()
                )
                .as_str()
            )
        );
        // An unknown dtype, checked in offset order: "b" comes first in the data.
        let f = file(
            &two(
                &serde_json::json!({"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]}),
                &serde_json::json!({"dtype": "X9", "shape": [2], "data_offsets": [0, 4]}),
            ),
            8,
        );
        assert!(safetensors::SafeTensors::deserialize(&f).is_err());
        assert_eq!(explain(&f).as_deref(), Some("tensor b: unknown dtype X9"));
        // A cut through several tensors names the first the data ends inside, in offset order, and counts them.
        let h = serde_json::json!({
            "z": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "y": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
            "x": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
        });
        let f = file(&h, 6);
        assert!(safetensors::SafeTensors::deserialize(&f).is_err());
        assert_eq!(
            explain(&f).as_deref(),
            Some(
                "tensor y: its data_offsets end at byte 8 of the data, past the 6 bytes the file holds after its \
                 header (truncated? 2 tensors lie past that point)"
            )
        );
    }

    #[test]
    fn what_this_reading_cannot_parse_is_left_to_the_crate() {
        // A header that is not JSON, not an object, or with a negative offset or a fractional dim.
        for h in [
            b"not json".to_vec(),
            b"[1, 2]".to_vec(),
            serde_json::json!({"a": {"dtype": "U8", "shape": [4], "data_offsets": [-1, 3]}})
                .to_string()
                .into_bytes(),
            serde_json::json!({"a": {"dtype": "U8", "shape": [1.5], "data_offsets": [0, 4]}})
                .to_string()
                .into_bytes(),
        ] {
            let mut f = (h.len() as u64).to_le_bytes().to_vec();
            f.extend_from_slice(&h);
            f.resize(f.len() + 4, 0);
            assert!(safetensors::SafeTensors::deserialize(&f).is_err());
            assert_eq!(explain(&f), None, "{}", String::from_utf8_lossy(&h));
        }
        // Fewer than 8 bytes.
        assert_eq!(explain(b"abc"), None);
    }
}
