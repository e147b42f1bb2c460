//! A report's chart: daily busy and idle GPU-hours per group as stacked
//! bars, with a legend, drawn as SVG (plotters' SVG backend, no fonts: the
//! viewer renders the text). `rota report --chart` and
//! `/v1/report?format=svg` draw the same chart.

use plotters::prelude::*;

use rota_core::report::Report;
use rota_core::state::tenancy::{gpu_hours, month_text};

/// Chart size, pixels.
const WIDTH_PX: u32 = 1_000;
const HEIGHT_PX: u32 = 520;
/// Groups drawn with their own colour at most; the rest are summed as one.
const MAX_GROUPS_DRAWN: usize = 12;
const OTHER_GROUPS: &str = "(other groups)";

const PALETTE: [RGBColor; MAX_GROUPS_DRAWN + 1] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(57, 59, 121),
    RGBColor(99, 121, 57),
    RGBColor(82, 84, 163),
];

#[derive(Debug, thiserror::Error)]
#[error("drawing the chart: {0}")]
pub struct ChartError(String);

/// Per group (at most `MAX_GROUPS_DRAWN`, the largest users; the rest as
/// one), the daily busy and idle GPU-hours.
fn series(report: &Report) -> Vec<(String, Vec<(f64, f64)>)> {
    let days = report.days();
    let mut groups: Vec<(&String, u64)> =
        report.daily.iter().map(|(group, days)| (group, days.iter().map(|d| d.busy_gpu_ms + d.idle_gpu_ms).sum())).collect();
    groups.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut drawn: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut other = vec![(0.0, 0.0); days];
    for (i, (group, _)) in groups.iter().enumerate() {
        let daily = &report.daily[*group];
        let values = (0..days).map(|day| daily.get(day).map_or((0.0, 0.0), |d| (gpu_hours(d.busy_gpu_ms), gpu_hours(d.idle_gpu_ms))));
        if i < MAX_GROUPS_DRAWN {
            drawn.push(((*group).clone(), values.collect()));
        } else {
            for (slot, (busy, idle)) in other.iter_mut().zip(values) {
                slot.0 += busy;
                slot.1 += idle;
            }
        }
    }
    if groups.len() > MAX_GROUPS_DRAWN {
        drawn.push((OTHER_GROUPS.to_string(), other));
    }
    drawn
}

/// The chart of `report` as an SVG document.
pub fn report_svg(report: &Report) -> Result<String, ChartError> {
    let mut svg = String::new();
    draw(report, &mut svg).map_err(|e| ChartError(e.to_string()))?;
    Ok(svg)
}

fn draw<'a>(report: &Report, svg: &'a mut String) -> Result<(), Box<dyn std::error::Error + 'a>> {
    let days = report.days();
    let groups = series(report);
    let highest = (0..days).map(|day| groups.iter().map(|(_, values)| values[day].0 + values[day].1).sum::<f64>()).fold(0.0_f64, f64::max);
    let top = if highest > 0.0 { highest * 1.1 } else { 1.0 };
    let root = SVGBackend::with_string(svg, (WIDTH_PX, HEIGHT_PX)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("GPU-hours per day, {} (busy solid, idle light)", month_text(report.month)), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d(0.5_f64..(days as f64 + 0.5), 0.0_f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("day of month (UTC)")
        .y_desc("GPU-hours")
        .y_label_formatter(&|hours| format!("{:.*}", label_decimals(top), hours))
        .x_labels(days.min(31))
        .x_label_formatter(&|day| format!("{}", day.round() as u32))
        .draw()?;
    let mut base = vec![0.0_f64; days];
    for (i, (group, values)) in groups.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let light = colour.mix(0.35);
        let busy = stack_bars(&mut base, values.iter().map(|v| v.0), colour.filled());
        let idle = stack_bars(&mut base, values.iter().map(|v| v.1), light.filled());
        chart
            .draw_series(busy)?
            .label(format!("{group} busy"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], colour.filled()));
        chart
            .draw_series(idle)?
            .label(format!("{group} idle"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], light.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Decimals that tell the axis' ticks apart when it reaches `top` (a month
/// of short test jobs is a few millionths of a GPU-hour a day).
fn label_decimals(top: f64) -> usize {
    let tick = top / 10.0;
    if tick <= 0.0 || !tick.is_finite() {
        return 0;
    }
    (-tick.log10()).ceil().clamp(0.0, 9.0) as usize
}

/// One bar per day with a value, drawn on top of `base`, which then rises by it.
fn stack_bars(base: &mut [f64], values: impl Iterator<Item = f64>, style: ShapeStyle) -> Vec<Rectangle<(f64, f64)>> {
    let mut bars = Vec::new();
    for ((day, slot), value) in base.iter_mut().enumerate().zip(values) {
        if value > 0.0 {
            let x = day as f64 + 1.0;
            bars.push(Rectangle::new([(x - 0.4, *slot), (x + 0.4, *slot + value)], style));
        }
        *slot += value;
    }
    bars
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_labels_have_the_decimals_their_ticks_need() {
        assert_eq!(label_decimals(0.000_022), 6);
        assert_eq!(label_decimals(1.1), 1);
        assert_eq!(label_decimals(110.0), 0);
        assert_eq!(label_decimals(0.0), 0);
    }
    use rota_core::report::{DayUse, ReportBy};
    use std::collections::BTreeMap;

    fn report(groups: usize) -> Report {
        let daily = (0..groups)
            .map(|g| {
                let days = (0..31).map(|d| DayUse { busy_gpu_ms: (d as u64 + g as u64) * 3_600_000, idle_gpu_ms: 1_800_000 }).collect();
                (format!("group-{g}"), days)
            })
            .collect::<BTreeMap<_, _>>();
        Report { month: 202_612, by: ReportBy::Group, rows: vec![], daily }
    }

    fn texts(svg: &str) -> Vec<String> {
        let document = roxmltree::Document::parse(svg).expect("the chart is well-formed XML");
        assert_eq!(document.root_element().tag_name().name(), "svg");
        document
            .descendants()
            .filter(|n| n.is_text())
            .filter_map(|n| n.text())
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect()
    }

    #[test]
    fn the_chart_is_svg_naming_every_group_in_its_legend() {
        let svg = report_svg(&report(2)).unwrap();
        let texts = texts(&svg);
        for wanted in ["group-0 busy", "group-0 idle", "group-1 busy", "group-1 idle", "GPU-hours"] {
            assert!(texts.iter().any(|t| t.contains(wanted)), "{wanted} in {texts:?}");
        }
    }

    #[test]
    fn many_groups_are_bounded_and_an_empty_month_still_draws() {
        let many = texts(&report_svg(&report(MAX_GROUPS_DRAWN + 5)).unwrap());
        assert!(many.iter().any(|t| t.contains(OTHER_GROUPS)));
        assert_eq!(many.iter().filter(|t| t.ends_with(" busy")).count(), MAX_GROUPS_DRAWN + 1, "{many:?}");
        let empty = Report { daily: BTreeMap::new(), ..report(0) };
        texts(&report_svg(&empty).unwrap());
    }
}
