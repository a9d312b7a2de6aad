// fasta2a: an SVG picture of the alpha-beta model's timeline, a FAST plan above direct sending.
// What it draws is the cost model's schedule (cost_model.hpp), computed from bytes and
// bandwidths: nothing in it was measured.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "fasta2a/common.hpp"
#include "fasta2a/cost_model.hpp"

namespace fasta2a {

/// Wording and size of write_timeline_svg's drawing.
struct timeline_style {
  std::string fast_label = "FAST";     ///< name of the upper panel's plan, e.g. "FAST (birkhoff)"
  std::string direct_label = "direct"; ///< name of the lower panel's plan
  std::string note;                    ///< one more caption line (model parameters, input), may be empty
  rank_t max_ranks = 64;               ///< lanes are drawn for ranks below this only
  double width_px = 1200;              ///< width of the picture
};

namespace detail {

/// `text` made safe for XML character data and attribute values: the five special characters are
/// escaped, and whatever XML 1.0 cannot hold at all (most control characters, bytes that are not
/// UTF-8, U+FFFE and U+FFFF) becomes '?'. Titles carry file names, which may be any bytes.
inline std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += (c < 0x20 && c != '\t' && c != '\n' && c != '\r') ? '?' : static_cast<char>(c);
      }
      ++i;
      continue;
    }
    const std::size_t len = detail::utf8_sequence_length(text, i);
    bool valid = len > 0;
    // U+FFFE and U+FFFF are UTF-8 but not XML characters.
    if (valid && len == 3 && c == 0xEF && byte(i + 1) == 0xBF && byte(i + 2) >= 0xBE) valid = false;
    if (!valid) {
      out += '?';
      ++i;
      continue;
    }
    out.append(text.substr(i, len));
    i += len;
  }
  return out;
}

/// A coordinate for SVG: fixed notation (an SVG reader need not accept every exponent form), two
/// decimals, and 0 in place of anything not finite so that the document stays well formed.
inline std::string svg_number(double x) {
  if (!std::isfinite(x)) x = 0;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  return buf;
}

/// A time for people: ms from one millisecond up, else us.
inline std::string human_time(double seconds) {
  char buf[64];
  if (!std::isfinite(seconds)) return "n/a";
  if (std::fabs(seconds) >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", seconds * 1e3);
  else std::snprintf(buf, sizeof buf, "%.2f us", seconds * 1e6);
  return buf;
}

/// A tick spacing of 1, 2 or 5 times a power of ten giving at most about `ticks` intervals.
inline double nice_step(double range, int ticks) {
  const double raw = range / ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

} // namespace detail

/// Writes a self-contained SVG document of the alpha-beta model's timelines of two plans of one
/// traffic matrix: `fast` in the upper panel, `direct` in the lower, on one time axis (the same
/// seconds-to-pixels scale, ticks in ms or us). Each panel has, per server, one lane per NIC
/// ("nic k") and one per scale-up port ("up k"), k the GPU's local index. Blocks are coloured by
/// their `stage` (a palette that cycles; the model gives a NIC block its rail stage and a scale-up
/// block its pipeline step, whose balance feeds the stage of the same number), blocks without a
/// stage (intra-server and direct traffic) are grey. A dashed line marks `lower_bound_s`, a solid
/// one each plan's predicted total, and the caption says that this is the model and gives the
/// predicted totals. Only ranks below `style.max_ranks` get lanes; the caption says so when ranks
/// are left out.
///
/// Both predictions must come from `predict(..., timeline = true)` for a topology of `ranks` ranks
/// in servers of `gpus_per_server`. Throws fasta2a::error if ranks or gpus_per_server is not
/// positive, or a prediction that takes time has no blocks (it was made without the timeline).
inline void write_timeline_svg(std::ostream& os, const std::string& title, const prediction& fast,
                               const prediction& direct, rank_t ranks, int gpus_per_server,
                               double lower_bound_s, const timeline_style& style = {}) {
  using detail::svg_number;
  using detail::xml_escape;
  if (ranks < 1 || gpus_per_server < 1)
    throw error("write_timeline_svg: needs at least one rank and one GPU per server (got " +
                std::to_string(ranks) + " ranks, " + std::to_string(gpus_per_server) + " GPUs per server)");
  for (const prediction* p : {&fast, &direct})
    if (p->blocks.empty() && p->total_s > 0)
      throw error("write_timeline_svg: a prediction has no timeline blocks; "
                  "make it with predict(topology, plan, cost_params, /*timeline=*/true)");

  const rank_t shown = std::clamp<rank_t>(style.max_ranks, 1, ranks);
  const int G = gpus_per_server;
  const int groups = (shown + G - 1) / G; // servers with at least one lane drawn

  // Every length below is in pixels; lanes shrink as ranks grow so 64 ranks stay on one page.
  const double lane_h = shown <= 16 ? 12 : shown <= 32 ? 9 : 7;
  const double font_lane = lane_h - 1.5;
  const double group_gap = 4;
  const double left = 130, right = 30;
  const double width = std::max(style.width_px, left + right + 200);
  const double plot_w = width - left - right;
  const double title_h = 34, panel_head = 22, axis_h = 30, panel_gap = 16;
  const double lanes_h = 2 * shown * lane_h + (groups - 1) * group_gap;
  const double panel_h = panel_head + lanes_h + axis_h;

  double t_max = std::max({fast.total_s, direct.total_s, lower_bound_s, 0.0});
  for (const prediction* p : {&fast, &direct})
    for (const timeline_block& b : p->blocks) t_max = std::max(t_max, b.end_s);
  if (!(t_max > 0) || !std::isfinite(t_max)) t_max = 1e-6; // nothing moves: any scale will do
  const auto x_of = [&](double s) { return left + plot_w * std::clamp(s, 0.0, t_max) / t_max; };

  const bool in_ms = t_max >= 1e-3;
  const double unit = in_ms ? 1e3 : 1e6;
  const double step = detail::nice_step(t_max * unit, 8) / unit;

  std::string ratio;
  if (fast.total_s > 0 && lower_bound_s > 0) {
    char b[64];
    std::snprintf(b, sizeof b, " (%.2fx the lower bound)", fast.total_s / lower_bound_s);
    ratio = b;
  }
  std::vector<std::string> caption;
  caption.push_back("Alpha-beta MODEL of time (predicted from bytes and bandwidths, not measured). " +
                    style.fast_label + ": " + detail::human_time(fast.total_s) + " in " +
                    std::to_string(fast.stages) + " stages" + ratio + "; " + style.direct_label + ": " +
                    detail::human_time(direct.total_s) + "; lower bound " +
                    detail::human_time(lower_bound_s) + ".");
  caption.push_back("Colour = stage (palette cycles; a scale-up block's colour is its pipeline step, "
                    "the balance of the stage of that number); grey = intra-server or direct traffic; "
                    "dashed = lower bound; solid = predicted total.");
  if (shown < ranks)
    caption.push_back("Showing the lanes of the first " + std::to_string(shown) + " of " +
                      std::to_string(ranks) + " ranks only.");
  if (!style.note.empty()) caption.push_back(style.note);
  const double legend_h = 22, caption_line = 15;
  const double height =
      title_h + 2 * panel_h + panel_gap + legend_h + caption_line * static_cast<double>(caption.size()) + 12;

  // Colour-blind-friendly qualitative palette (Tableau 10).
  static constexpr const char* palette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                                            "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#17becf"};
  constexpr int colours = static_cast<int>(sizeof palette / sizeof palette[0]);
  const auto colour = [&](std::int32_t stage) { return stage < 0 ? "#9e9e9e" : palette[stage % colours]; };

  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << svg_number(width) << "\" height=\""
     << svg_number(height) << "\" viewBox=\"0 0 " << svg_number(width) << ' ' << svg_number(height)
     << "\" font-family=\"sans-serif\">\n"
     << "<title>" << xml_escape(title) << "</title>\n"
     << "<rect x=\"0\" y=\"0\" width=\"" << svg_number(width) << "\" height=\"" << svg_number(height)
     << "\" fill=\"white\"/>\n"
     << "<text x=\"" << svg_number(left) << "\" y=\"22\" font-size=\"15\" font-weight=\"bold\">"
     << xml_escape(title) << "</text>\n";

  // The lane of (rank, NIC or scale-up) inside a panel whose lanes start at `top`: per server its
  // NICs, then its scale-up ports, so a server's rail traffic reads as one band.
  const auto lane_y = [&](double top, rank_t r, bool nic) {
    const int s = r / G, k = r % G;
    const int in_group = std::min<rank_t>(G, shown - s * G); // the last server may be cut short
    const int lane = s * 2 * G + (nic ? k : in_group + k);
    return top + lane * lane_h + s * group_gap;
  };

  const auto draw_panel = [&](double y0, const prediction& p, const std::string& label) {
    os << "<g>\n<text x=\"" << svg_number(left) << "\" y=\"" << svg_number(y0 + 15) << "\" font-size=\"13\">"
       << xml_escape(label) << ": predicted " << xml_escape(detail::human_time(p.total_s)) << " (model)";
    if (p.stages > 0) os << ", " << p.stages << " stages";
    os << "</text>\n";
    const double top = y0 + panel_head;
    // Lane backgrounds and labels.
    for (int s = 0; s < groups; ++s) {
      const int in_group = std::min<rank_t>(G, shown - s * G);
      const double gy = lane_y(top, s * G, true);
      const double gh = 2 * in_group * lane_h;
      os << "<rect x=\"" << svg_number(left) << "\" y=\"" << svg_number(gy) << "\" width=\""
         << svg_number(plot_w) << "\" height=\"" << svg_number(gh) << "\" fill=\""
         << (s % 2 ? "#f4f4f4" : "#fafafa") << "\" stroke=\"#dddddd\" stroke-width=\"0.5\"/>\n";
      os << "<text x=\"6\" y=\"" << svg_number(gy + gh / 2 + 4) << "\" font-size=\"11\">server " << s
         << "</text>\n";
      for (int k = 0; k < in_group; ++k)
        for (bool nic : {true, false})
          os << "<text x=\"" << svg_number(left - 6) << "\" y=\""
             << svg_number(lane_y(top, s * G + k, nic) + lane_h - 2) << "\" font-size=\""
             << svg_number(font_lane) << "\" text-anchor=\"end\">" << (nic ? "nic " : "up ") << k
             << "</text>\n";
    }
    // Grey (stageless) blocks first, so staged blocks that share their time stay visible on top.
    for (int pass = 0; pass < 2; ++pass)
      for (const timeline_block& b : p.blocks) {
        if (b.rank < 0 || b.rank >= shown || (b.stage < 0) != (pass == 0)) continue;
        const bool nic = b.lane == timeline_block::nic;
        const double x = x_of(b.start_s);
        const double w = std::max(x_of(b.end_s) - x, 0.6); // a sliver stays visible
        os << "<rect x=\"" << svg_number(x) << "\" y=\"" << svg_number(lane_y(top, b.rank, nic) + 1)
           << "\" width=\"" << svg_number(w) << "\" height=\"" << svg_number(lane_h - 2) << "\" fill=\""
           << colour(b.stage) << "\" fill-opacity=\"0.9\"><title>" << (nic ? "nic" : "up") << " of rank "
           << b.rank;
        if (b.stage >= 0) os << ", " << (nic ? "stage " : "step ") << b.stage;
        os << ": " << xml_escape(detail::human_time(b.start_s)) << " to "
           << xml_escape(detail::human_time(b.end_s)) << "</title></rect>\n";
      }
    const double bottom = top + lanes_h;
    // Axis: ticks on the shared scale.
    os << "<line x1=\"" << svg_number(left) << "\" y1=\"" << svg_number(bottom + 2) << "\" x2=\""
       << svg_number(left + plot_w) << "\" y2=\"" << svg_number(bottom + 2)
       << "\" stroke=\"black\" stroke-width=\"1\"/>\n";
    for (int i = 0;; ++i) {
      const double t = i * step;
      if (t > t_max * (1 + 1e-9)) break;
      const double x = x_of(t);
      char tick[48];
      std::snprintf(tick, sizeof tick, "%g", t * unit);
      os << "<line x1=\"" << svg_number(x) << "\" y1=\"" << svg_number(bottom + 2) << "\" x2=\""
         << svg_number(x) << "\" y2=\"" << svg_number(bottom + 6) << "\" stroke=\"black\"/>\n"
         << "<text x=\"" << svg_number(x) << "\" y=\"" << svg_number(bottom + 17)
         << "\" font-size=\"10\" text-anchor=\"middle\">" << tick << "</text>\n";
    }
    os << "<text x=\"" << svg_number(left + plot_w) << "\" y=\"" << svg_number(bottom + 28)
       << "\" font-size=\"10\" text-anchor=\"end\">time (" << (in_ms ? "ms" : "us")
       << ", alpha-beta model)</text>\n";
    // Markers over the lanes: the lower bound (dashed) and this plan's predicted total (solid).
    const auto marker = [&](double s, const char* stroke, const char* dash, const char* text) {
      const double x = x_of(s);
      os << "<line x1=\"" << svg_number(x) << "\" y1=\"" << svg_number(top - 4) << "\" x2=\"" << svg_number(x)
         << "\" y2=\"" << svg_number(bottom + 2) << "\" stroke=\"" << stroke << "\" stroke-width=\"1.5\""
         << dash << "><title>" << text << "</title></line>\n";
    };
    const std::string lb_text = "lower bound " + xml_escape(detail::human_time(lower_bound_s));
    const std::string total_text = "predicted total " + xml_escape(detail::human_time(p.total_s));
    marker(lower_bound_s, "#c00000", " stroke-dasharray=\"6,4\"", lb_text.c_str());
    marker(p.total_s, "#202020", "", total_text.c_str());
    os << "</g>\n";
  };

  const double upper = title_h, lower = title_h + panel_h + panel_gap;
  draw_panel(upper, fast, style.fast_label);
  draw_panel(lower, direct, style.direct_label);

  // Legend: the grey of stageless traffic and the palette.
  double ly = lower + panel_h + 14;
  double lx = left;
  const auto swatch = [&](const char* fill, const std::string& text) {
    os << "<rect x=\"" << svg_number(lx) << "\" y=\"" << svg_number(ly - 9)
       << "\" width=\"10\" height=\"10\" fill=\"" << fill << "\"/>\n<text x=\"" << svg_number(lx + 14)
       << "\" y=\"" << svg_number(ly) << "\" font-size=\"10\">" << xml_escape(text) << "</text>\n";
    lx += 22 + 6.0 * static_cast<double>(text.size());
  };
  swatch("#9e9e9e", "no stage (intra-server, direct)");
  for (int i = 0; i < colours; ++i)
    swatch(palette[i], "stage " + std::to_string(i) + (i == colours - 1 ? " (then cycles)" : ""));
  ly += legend_h - 6;
  for (const std::string& line : caption) {
    os << "<text x=\"6\" y=\"" << svg_number(ly) << "\" font-size=\"11\">" << xml_escape(line) << "</text>\n";
    ly += caption_line;
  }
  os << "</svg>\n";
}

} // namespace fasta2a
