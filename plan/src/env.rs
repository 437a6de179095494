//! Environment variables read the same way everywhere. On/off switches: `1` or `0`, anything else refused by name
//! (the CUDA backend's `FLASHPLAN_PDL`, `FLASHPLAN_FUSE_LINEAR`, `FLASHPLAN_FUSE_SMALL`, the engine's
//! `FLASHPLAN_COPY_DRAFTS`, the test switches), so that a misspelt `true` or `on` never passes for off. Folders
//! (`FLASHPLAN_CACHE`, `FLASHPLAN_KERNEL_CACHE`): set but empty is refused, since it would mean the current directory.

use std::path::PathBuf;

/// A switch's value that is neither `1` nor `0` (or not valid UTF-8).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable {name}={value:?} is not accepted: expected 1 or 0")]
pub struct SwitchError {
    /// The variable's name.
    pub name: String,
    /// Its value as set (lossily decoded when it is not UTF-8).
    pub value: String,
}

/// The switch `name` from the environment: `None` when unset, `Some(true)` for `1`, `Some(false)` for `0`.
///
/// # Errors
/// [`SwitchError`] for any other value, including an empty one and one that is not UTF-8.
pub fn switch(name: &str) -> Result<Option<bool>, SwitchError> {
    parse_switch(name, std::env::var_os(name))
}

/// [`switch`] on a value already read (`None`: unset).
///
/// # Errors
/// As [`switch`].
pub fn parse_switch(
    name: &str,
    value: Option<std::ffi::OsString>,
) -> Result<Option<bool>, SwitchError> {
    let Some(v) = value else {
        return Ok(None);
    };
    match v.to_str() {
        Some("1") => Ok(Some(true)),
        Some("0") => Ok(Some(false)),
        _ => Err(SwitchError {
            name: name.to_string(),
            value: v.to_string_lossy().into_owned(),
        }),
    }
}

/// A folder variable that is set but empty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name} is set but empty: expected a folder")]
pub struct EmptyFolder {
    /// The variable's name.
    pub name: String,
}

/// The folder named by the variable `name`: `None` when unset.
///
/// # Errors
/// [`EmptyFolder`] when it is set but empty (it would mean the current directory).
pub fn folder(name: &str) -> Result<Option<PathBuf>, EmptyFolder> {
    parse_folder(name, std::env::var_os(name))
}

/// [`folder`] on a value already read (`None`: unset).
///
/// # Errors
/// As [`folder`].
pub fn parse_folder(
    name: &str,
    value: Option<std::ffi::OsString>,
) -> Result<Option<PathBuf>, EmptyFolder> {
    match value {
        Some(d) if d.is_empty() => Err(EmptyFolder {
            name: name.to_string(),
        }),
        d => Ok(d.map(PathBuf::from)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn one_and_zero_are_on_and_off_and_unset_is_none() {
        assert_eq!(parse_switch("X", None), Ok(None));
        assert_eq!(parse_switch("X", Some("1".into())), Ok(Some(true)));
        assert_eq!(parse_switch("X", Some("0".into())), Ok(Some(false)));
    }

    #[test]
    fn every_other_value_is_refused_by_name() {
        for v in ["", "true", "on", "yes", " 1", "1 ", "01", "2", "off"] {
            let e = parse_switch("FLASHPLAN_PDL", Some(v.into())).unwrap_err();
            assert_eq!((e.name.as_str(), e.value.as_str()), ("FLASHPLAN_PDL", v));
            assert_eq!(
                e.to_string(),
                format!(
                    "environment variable FLASHPLAN_PDL={v:?} is not accepted: expected 1 or 0"
                )
            );
        }
    }

    #[test]
    fn a_folder_is_its_value_and_an_empty_one_is_refused() {
        assert_eq!(parse_folder("FLASHPLAN_CACHE", None), Ok(None));
        assert_eq!(
            parse_folder("FLASHPLAN_CACHE", Some("/tmp/p".into())),
            Ok(Some(PathBuf::from("/tmp/p")))
        );
        assert_eq!(
            parse_folder("FLASHPLAN_CACHE", Some("".into())),
            Err(EmptyFolder {
                name: "FLASHPLAN_CACHE".into()
            })
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_value_that_is_not_utf8_is_refused() {
        use std::os::unix::ffi::OsStringExt;
        let v = OsString::from_vec(vec![b'1', 0xff]);
        let e = parse_switch("FLASHPLAN_GPU", Some(v)).unwrap_err();
        assert_eq!(
            (e.name.as_str(), e.value.as_str()),
            ("FLASHPLAN_GPU", "1\u{FFFD}")
        );
    }
}
