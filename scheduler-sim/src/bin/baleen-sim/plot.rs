//! `--plot FILE.svg`: unallocated GPU % against arrived workload % for each policy of a run,
//! like the allocation figure of the FGD paper.

use baleen_scheduler_sim::replay::PolicySummary;
use plotters::prelude::*;
use std::path::Path;

const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// Draws the mean unallocated-% curve of each summary into an SVG file at `path`.
pub(crate) fn unallocated_svg(path: &Path, summaries: &[PolicySummary]) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| format!("{}: cannot draw the plot: {e}", path.display());
    let Some(first) = summaries.first() else { return Err(fail(&"no policy to plot")) };
    let max_y = summaries
        .iter()
        .flat_map(|s| s.curves.unallocated_pct.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let top = (max_y / 10.0).ceil() * 10.0;
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let title = format!(
        "{}: unallocated GPU vs arrived workload (mean of {} seeds)",
        first.workload,
        first.seeds.len()
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..130f64, 0f64..top.max(10.0))
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("arrived GPU demand, % of cluster capacity")
        .y_desc("unallocated GPU, %")
        .draw()
        .map_err(|e| fail(&e))?;
    for (k, s) in summaries.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let points: Vec<(f64, f64)> = s
            .curves
            .arrived_pct
            .iter()
            .zip(&s.curves.unallocated_pct)
            .filter(|(_, y)| y.is_finite())
            .map(|(&x, &y)| (f64::from(x), y))
            .collect();
        let at100 = s.unallocated_pct_at_100.mean;
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(format!("{} ({at100:.2} % at 100)", s.policy))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))
}
