//! GPU model names as people write them.
//!
//! rota names a GPU `FAMILY-NNGB` from what NVML reports: the family word
//! of the product name and the memory rounded to whole GiB. Vendors sell
//! the same part by a rounded decimal size: an H200 reports 143,771 MiB,
//! which rota names `H200-140GB`, while it is sold as the "H200 141GB"; an
//! L40S reports 46,068 MiB (`L40S-45GB`) and is sold as 48 GB. A job may
//! therefore name the family alone (`H200`), or a size that is within
//! `SIZE_TOLERANCE_PERCENT` of the GPU's. Sizes that far apart are
//! different parts (H100 80 GB and H100 NVL 94 GB are 15 % apart).
//!
//! Which rule applies is replicated state: apply checks every placement
//! against the model a job asked for, so replicas of one cluster must
//! agree. The alias rule is used from cluster version
//! `ALIASES_FROM_VERSION` on, once every replica has it; before that a
//! name matches only itself.

/// The first cluster version whose replicas all match aliases.
pub const ALIASES_FROM_VERSION: u16 = 6;

/// Two sizes name the same part when they differ by at most this share
/// of the larger one.
pub const SIZE_TOLERANCE_PERCENT: u64 = 8;

/// A model name split into its family and, where given, its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ModelName<'a> {
    family: &'a str,
    size_gb: Option<u64>,
}

fn parse(name: &str) -> ModelName<'_> {
    let sized = name.rsplit_once('-').and_then(|(family, suffix)| {
        let digits = suffix.strip_suffix("GB").or_else(|| suffix.strip_suffix("gb"))?;
        let size_gb = digits.parse::<u64>().ok()?;
        (!family.is_empty()).then_some(ModelName { family, size_gb: Some(size_gb) })
    });
    sized.unwrap_or(ModelName { family: name, size_gb: None })
}

fn sizes_close(a_gb: u64, b_gb: u64) -> bool {
    let larger = a_gb.max(b_gb);
    a_gb.abs_diff(b_gb).saturating_mul(100) <= larger.saturating_mul(SIZE_TOLERANCE_PERCENT)
}

/// Does a GPU that rota names `offered` satisfy a job asking for `asked`?
/// With `aliases` off, only the same name does.
pub fn model_matches(asked: &str, offered: &str, aliases: bool) -> bool {
    if asked == offered {
        return true;
    }
    if !aliases {
        return false;
    }
    let (asked, offered) = (parse(asked), parse(offered));
    if !asked.family.eq_ignore_ascii_case(offered.family) {
        return false;
    }
    match (asked.size_gb, offered.size_gb) {
        (None, _) => true,
        (Some(a), Some(b)) => sizes_close(a, b),
        // A GPU named without a size cannot be shown to have it.
        (Some(_), None) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sold_size_matches_the_reported_one() {
        assert!(model_matches("H200-141GB", "H200-140GB", true));
        assert!(model_matches("h200-141gb", "H200-140GB", true), "case does not matter");
        assert!(model_matches("L40S-48GB", "L40S-45GB", true));
        assert!(model_matches("H100-80GB", "H100-80GB", false), "the same name matches without aliases");
    }

    #[test]
    fn the_family_alone_matches_every_size() {
        assert!(model_matches("H200", "H200-140GB", true));
        assert!(model_matches("A100", "A100-40GB", true));
        assert!(model_matches("A100", "A100-80GB", true));
    }

    #[test]
    fn other_parts_and_the_old_rule_do_not_match() {
        assert!(!model_matches("H100-94GB", "H100-80GB", true), "H100 NVL is another part");
        assert!(!model_matches("A100-40GB", "A100-80GB", true));
        assert!(!model_matches("H100", "H200-140GB", true));
        assert!(!model_matches("H20", "H200-140GB", true), "a family is a whole word, not a prefix");
        assert!(!model_matches("H200-141GB", "H200-140GB", false), "before the cluster has aliases");
        assert!(!model_matches("H200", "H200-140GB", false));
        assert!(!model_matches("H200-141GB", "H200", true), "a sizeless GPU name proves no size");
        assert!(!model_matches("-80GB", "H100-80GB", true));
    }

    #[test]
    fn tolerance_is_symmetric_and_bounded() {
        for (a, b) in [(80, 80), (141, 140), (48, 45), (40, 80), (80, 94), (0, 0), (0, 1), (u64::MAX, u64::MAX - 1)] {
            assert_eq!(sizes_close(a, b), sizes_close(b, a), "{a} and {b}");
        }
        assert!(sizes_close(100, 92) && !sizes_close(100, 91));
    }
}
