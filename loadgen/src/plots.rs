//! SVG plots of a run (plotters, SVG backend): latency CDF (e2e and TTFT), the per-request
//! tokens/s CDF with the SLO floor, and e2e latency over time by send time; and the
//! benchmark's goodput-versus-offered-load curves, one line per policy.
//!
//! Only successful requests are plotted as latencies; failed ones appear as red marks on
//! the over-time plot so bursts of errors are visible where they happened. An empty run
//! still produces valid (empty) charts, so the files always exist after `write_outputs`.

use std::path::Path;

use plotters::prelude::*;

use crate::error::LoadError;
use crate::record::RequestRecord;
use crate::spec::Slo;
use crate::stats;

const SIZE: (u32, u32) = (960, 600);
const WIDE: (u32, u32) = (1280, 560);

fn plot_err(path: &Path) -> impl Fn(String) -> LoadError + '_ {
    move |reason| LoadError::Plot {
        path: path.display().to_string(),
        reason,
    }
}

/// Upper axis bound with a little headroom; 1 when there is no data.
fn upper(max: Option<f64>) -> f64 {
    match max {
        Some(m) if m > 0.0 => m * 1.05,
        _ => 1.0,
    }
}

/// Latency CDF: e2e and TTFT in seconds.
pub fn latency_cdf(path: &Path, records: &[RequestRecord]) -> Result<(), LoadError> {
    let ok = || records.iter().filter(|r| r.ok);
    let e2e = stats::sorted_finite(
        &ok()
            .filter_map(|r| r.e2e_ms.map(|v| v / 1000.0))
            .collect::<Vec<_>>(),
    );
    let ttft = stats::sorted_finite(
        &ok()
            .filter_map(|r| r.ttft_ms.map(|v| v / 1000.0))
            .collect::<Vec<_>>(),
    );
    let xmax = upper(
        e2e.last()
            .copied()
            .into_iter()
            .chain(ttft.last().copied())
            .max_by(f64::total_cmp),
    );
    draw(path, |root| {
        let mut chart = ChartBuilder::on(root)
            .caption("Latency CDF", ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..xmax, 0f64..1.0)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("latency (s)")
            .y_desc("fraction of requests")
            .draw()
            .map_err(|e| e.to_string())?;
        for (name, data, color) in [("e2e", &e2e, BLUE), ("TTFT", &ttft, RED)] {
            chart
                .draw_series(LineSeries::new(stats::ecdf(data), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(format!("{name} (n={})", data.len()))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
        Ok(())
    })
    .map_err(plot_err(path))
}

/// CDF of per-request tokens/s, with the SLO floor as a vertical line.
pub fn tokens_per_s_cdf(
    path: &Path,
    records: &[RequestRecord],
    slo: &Slo,
) -> Result<(), LoadError> {
    let rates = stats::sorted_finite(
        &records
            .iter()
            .filter(|r| r.ok)
            .filter_map(|r| r.tokens_per_s)
            .collect::<Vec<_>>(),
    );
    let xmax = upper(rates.last().copied().map(|m| m.max(slo.tok_s)));
    draw(path, |root| {
        let mut chart = ChartBuilder::on(root)
            .caption("Per-request tokens/s (CDF)", ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..xmax, 0f64..1.0)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("output tokens / (e2e - TTFT), tokens/s")
            .y_desc("fraction of requests")
            .draw()
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(LineSeries::new(stats::ecdf(&rates), BLUE.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(format!("tokens/s (n={})", rates.len()))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        chart
            .draw_series(LineSeries::new(
                vec![(slo.tok_s, 0.0), (slo.tok_s, 1.0)],
                RED.stroke_width(1),
            ))
            .map_err(|e| e.to_string())?
            .label(format!("SLO floor {} tok/s", slo.tok_s))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
        Ok(())
    })
    .map_err(plot_err(path))
}

/// e2e latency (s) of each request by its send time (s); failed requests in red.
pub fn latency_over_time(path: &Path, records: &[RequestRecord]) -> Result<(), LoadError> {
    let pts = |ok: bool| -> Vec<(f64, f64)> {
        records
            .iter()
            .filter(|r| r.ok == ok)
            .map(|r| (r.sent_s, r.e2e_ms.unwrap_or(0.0) / 1000.0))
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect()
    };
    let (good, bad) = (pts(true), pts(false));
    let all = || good.iter().chain(bad.iter());
    let xmax = upper(all().map(|p| p.0).max_by(f64::total_cmp));
    let ymax = upper(all().map(|p| p.1).max_by(f64::total_cmp));
    draw(path, |root| {
        let mut chart = ChartBuilder::on(root)
            .caption("End-to-end latency over time", ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("send time (s since start)")
            .y_desc("e2e latency (s)")
            .draw()
            .map_err(|e| e.to_string())?;
        for (name, data, color) in [("ok", &good, BLUE), ("error", &bad, RED)] {
            chart
                .draw_series(data.iter().map(|&p| Circle::new(p, 2, color.filled())))
                .map_err(|e| e.to_string())?
                .label(format!("{name} (n={})", data.len()))
                .legend(move |(x, y)| Circle::new((x + 10, y), 3, color.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
        Ok(())
    })
    .map_err(plot_err(path))
}

/// One line of a goodput curve: a policy and its points (offered load as a share of nominal
/// capacity, SLO attainment 0..1, goodput req/s), in load order.
#[derive(Debug, Clone, PartialEq)]
pub struct CurveSeries {
    pub name: String,
    pub points: Vec<(f64, f64, f64)>,
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

/// Goodput vs offered load: left, SLO attainment (with the 90 % line that defines capacity
/// at SLO); right, goodput in requests/s. x is the offered load in % of nominal capacity.
pub fn goodput_curves(path: &Path, title: &str, series: &[CurveSeries]) -> Result<(), LoadError> {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let xmax = upper(all().map(|p| p.0 * 100.0).max_by(f64::total_cmp));
    let ymax_rate = upper(all().map(|p| p.2).max_by(f64::total_cmp));
    draw_sized(path, WIDE, |root| {
        let (title_area, body) = root.split_vertically(40);
        title_area
            .titled(title, ("sans-serif", 22))
            .map_err(|e| e.to_string())?;
        let panels = body.split_evenly((1, 2));
        for (k, panel) in panels.iter().enumerate() {
            let (ymax, ydesc, caption) = if k == 0 {
                (1.0, "share of requests meeting the SLO", "SLO attainment")
            } else {
                (ymax_rate, "requests/s meeting the SLO", "goodput rate")
            };
            let mut chart = ChartBuilder::on(panel)
                .caption(caption, ("sans-serif", 18))
                .margin(15)
                .x_label_area_size(45)
                .y_label_area_size(60)
                .build_cartesian_2d(0f64..xmax, 0f64..ymax)
                .map_err(|e| e.to_string())?;
            chart
                .configure_mesh()
                .x_desc("offered load (% of nominal capacity)")
                .y_desc(ydesc)
                .draw()
                .map_err(|e| e.to_string())?;
            if k == 0 {
                chart
                    .draw_series(LineSeries::new(
                        vec![(0.0, 0.9), (xmax, 0.9)],
                        BLACK.mix(0.4).stroke_width(1),
                    ))
                    .map_err(|e| e.to_string())?
                    .label("90 % (capacity at SLO)")
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.4)));
            }
            for (i, s) in series.iter().enumerate() {
                let color = PALETTE[i % PALETTE.len()];
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|p| (p.0 * 100.0, if k == 0 { p.1 } else { p.2 }))
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(|e| e.to_string())?
                    .label(s.name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
            chart
                .configure_series_labels()
                .position(if k == 0 {
                    SeriesLabelPosition::LowerLeft
                } else {
                    SeriesLabelPosition::UpperLeft
                })
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    })
    .map_err(plot_err(path))
}

fn draw(
    path: &Path,
    body: impl FnOnce(&DrawingArea<SVGBackend<'_>, plotters::coord::Shift>) -> Result<(), String>,
) -> Result<(), String> {
    draw_sized(path, SIZE, body)
}

fn draw_sized(
    path: &Path,
    size: (u32, u32),
    body: impl FnOnce(&DrawingArea<SVGBackend<'_>, plotters::coord::Shift>) -> Result<(), String>,
) -> Result<(), String> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    body(&root)?;
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goodput_curves_write_an_svg_with_every_policy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("goodput.svg");
        let series = vec![
            CurveSeries {
                name: "metronome".into(),
                points: vec![(0.3, 1.0, 3.0), (0.9, 0.95, 8.5), (1.5, 0.4, 6.0)],
            },
            CurveSeries {
                name: "least_connections".into(),
                points: vec![(0.3, 0.98, 2.9), (0.9, 0.7, 6.3), (1.5, 0.2, 3.0)],
            },
        ];
        goodput_curves(&path, "chat on 4 equal GPUs", &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        for text in [
            "metronome",
            "least_connections",
            "SLO attainment",
            "goodput rate",
        ] {
            assert!(svg.contains(text), "{text}");
        }
        // No data still draws valid axes.
        goodput_curves(&path, "empty", &[]).unwrap();
    }
}
