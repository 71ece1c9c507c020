//! Grouped bar charts of reports as SVG. SVG keeps the plots free of system
//! fonts and image codecs: plotters lays text out with its built-in size
//! estimate and the viewer draws it.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::{ALL_OPS, Report, STORE_ORDER, summarise};

/// Size of a chart in pixels.
pub const CHART_SIZE: (u32, u32) = (1100, 520);
const FONT: &str = "sans-serif";
/// Colours of the stores, in [`STORE_ORDER`]; others get the last.
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(23, 190, 207),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(214, 39, 40),
    RGBColor(127, 127, 127),
];

/// Bars grouped by run configuration, one series per store.
#[derive(Debug, Clone, PartialEq)]
pub struct Bars {
    /// Label of each group, e.g. "A 32×1" or "A 2×16 (pipelined)".
    pub groups: Vec<String>,
    /// Store name and its value in each group (missing runs are `None`).
    pub series: Vec<(String, Vec<Option<f64>>)>,
}

impl Bars {
    /// Groups `reports` by workload and concurrency and takes `metric` of
    /// each (of the median run where a configuration ran more than once).
    pub fn from_reports(reports: &[Report], metric: impl Fn(&Report) -> Option<f64>) -> Bars {
        let sums = summarise(reports);
        let rs: Vec<&Report> = sums.iter().map(|s| &s.median).collect();
        // Pipelined groups say so, as the tables do.
        let key = |r: &Report| {
            let mode = if r.ycsb_comparable() { "" } else { " (pipelined)" };
            format!("{} {}{mode}", r.workload.to_uppercase(), r.concurrency())
        };
        let mut groups: Vec<String> = rs.iter().map(|r| key(r)).collect();
        groups.dedup();
        let mut stores: Vec<&str> = STORE_ORDER.iter().copied().filter(|s| rs.iter().any(|r| r.store == *s)).collect();
        for r in &rs {
            if !stores.contains(&r.store.as_str()) {
                stores.push(&r.store);
            }
        }
        let series = stores
            .iter()
            .map(|s| {
                let vals = groups
                    .iter()
                    .map(|g| rs.iter().find(|r| r.store == *s && key(r) == *g).and_then(|r| metric(r)))
                    .collect();
                (s.to_string(), vals)
            })
            .collect();
        Bars { groups, series }
    }

    fn max(&self) -> f64 {
        self.series.iter().flat_map(|(_, v)| v.iter().flatten()).copied().fold(0.0, f64::max)
    }
}

/// Throughput of every run.
pub fn throughput(reports: &[Report]) -> Bars {
    Bars::from_reports(reports, |r| Some(r.run.ops_per_sec))
}

/// 99th-percentile latency over all operations of every run, in µs.
pub fn p99(reports: &[Report]) -> Bars {
    Bars::from_reports(reports, |r| r.run.op(ALL_OPS).map(|o| o.p99_us))
}

fn colour(store: &str) -> RGBColor {
    let i = STORE_ORDER.iter().position(|s| *s == store).unwrap_or(COLOURS.len() - 1);
    COLOURS[i]
}

/// Draws `bars` as an SVG file at `path`.
pub fn bar_chart(path: &Path, title: &str, y_desc: &str, bars: &Bars) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let root = SVGBackend::new(path, CHART_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let n = bars.groups.len().max(1) as f64;
    let ymax = (bars.max() * 1.25).max(1.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(90)
        .build_cartesian_2d(0f64..n, 0f64..ymax)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars.groups.len() + 1)
        .x_label_formatter(&|_| String::new())
        .y_label_formatter(&|y| format!("{y:.0}"))
        .y_desc(y_desc)
        .label_style((FONT, 13))
        .draw()
        .map_err(|e| err(&e))?;
    let width = 0.8 / bars.series.len().max(1) as f64;
    let value_style = TextStyle::from((FONT, 11).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    for (j, (store, vals)) in bars.series.iter().enumerate() {
        let c = colour(store);
        let x0 = |i: usize| i as f64 + 0.1 + j as f64 * width;
        let rects = vals
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.map(|v| Rectangle::new([(x0(i), 0.0), (x0(i) + width * 0.92, v)], c.filled())));
        chart
            .draw_series(rects)
            .map_err(|e| err(&e))?
            .label(store.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
        let labels = vals.iter().enumerate().filter_map(|(i, v)| {
            v.map(|v| Text::new(format!("{v:.0}"), (x0(i) + width * 0.46, v), value_style.clone()))
        });
        chart.draw_series(labels).map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(|e| err(&e))?;
    let group_style = TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (i, g) in bars.groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        root.draw(&Text::new(g.clone(), (px, py + 8), group_style.clone())).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{new_histogram, test_report};

    fn report(store: &str, workload: &str, in_flight: usize, rate: f64) -> Report {
        let mut h = new_histogram();
        h.record(1000).unwrap();
        test_report(store, workload, 1, in_flight, rate, &h)
    }

    #[test]
    fn bars_group_by_configuration_and_store() {
        let rs = vec![report("redis", "a", 1, 5.0), report("dmkv", "a", 1, 7.0), report("dmkv", "b", 16, 9.0)];
        let b = throughput(&rs);
        assert_eq!(b.groups, vec!["A 1×1", "B 1×16 (pipelined)"]);
        assert_eq!(b.series[0], ("dmkv".to_string(), vec![Some(7.0), Some(9.0)]));
        assert_eq!(b.series[1], ("redis".to_string(), vec![Some(5.0), None]));
        assert_eq!(p99(&rs).series[0].1, vec![Some(1.0), Some(1.0)]);
    }

    #[test]
    fn charts_render_to_svg() {
        let rs = vec![report("memcached", "a", 1, 1234.0), report("dmkv", "a", 1, 4321.0)];
        let dir = std::env::temp_dir().join(format!("dmkv-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.svg");
        bar_chart(&path, "throughput", "ops/s", &throughput(&rs)).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(100)]);
        for s in ["memcached", "dmkv", "A 1×1", "4321", "1234"] {
            assert!(svg.contains(s), "{s} missing from the chart");
        }
    }
}
