// The types deploy/grafana/moed.json must satisfy. grafana_schema_test.sh writes the dashboard
// as a TypeScript literal (dashboard.gen.ts: `export const dashboard: MoeDashboard = {...}`) next
// to this file and runs tsc with strict checks, so:
// - the whole dashboard conforms to @grafana/schema's Dashboard (the published dashboard types);
// - every panel's options and fieldConfig conform to the published panel config of its type
//   (timeseries, heatmap, barchart, stat, table), and a misspelt or unknown field anywhere in a
//   literal is an error (excess property checks), which a plain JSON import would not catch.
import type * as G from '@grafana/schema';
import type * as TimeSeries from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';
import type * as Heatmap from '@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen';
import type * as BarChart from '@grafana/schema/dist/esm/raw/composable/barchart/panelcfg/x/BarChartPanelCfg_types.gen';
import type * as Stat from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type * as Table from '@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen';

// JSON spells a TypeScript string enum member as its value: map every string enum to the union
// of its values (`${E}`); numeric enums accept their number literals as they are.
export type Json<T> =
  T extends string ? `${T}` :
  T extends number | boolean | null | undefined ? T :
  T extends ReadonlyArray<infer U> ? Array<Json<U>> :
  T extends object ? { [K in keyof T]: Json<T[K]> } :
  T;

// A Prometheus query as Grafana's Prometheus data source stores it. @grafana/schema publishes
// only the common DataQuery part (refId, hide, datasource, ...); these are the data source's own.
export interface PromQuery extends G.DataQuery {
  expr: string;
  legendFormat?: string;
  format?: 'time_series' | 'table' | 'heatmap';
  instant?: boolean;
  range?: boolean;
  interval?: string;
  exemplar?: boolean;
  editorMode?: 'code' | 'builder';
}

// A Prometheus annotation: the query goes in target; the title, text and tag formats stay on the
// annotation, where the data source's annotation support reads them.
export interface PromAnnotation extends Omit<Json<G.AnnotationQuery>, 'target'> {
  target: Json<PromQuery>;
  titleFormat?: string;
  textFormat?: string;
  tagKeys?: string;
  useValueForTime?: boolean;
}

type FieldConfigSource<Custom> = Omit<Json<G.FieldConfigSource>, 'defaults'> & {
  defaults: Omit<Json<G.FieldConfig>, 'custom'> & { custom?: Json<Custom> };
};

type TypedPanel<Type extends string, Options, Custom> =
  Omit<Json<G.Panel>, 'type' | 'options' | 'fieldConfig' | 'targets'> & {
    type: Type;
    options: Json<Options>;
    fieldConfig: FieldConfigSource<Custom>;
    targets: Array<Json<PromQuery>>;
  };

export type MoePanel =
  | TypedPanel<'timeseries', TimeSeries.Options, TimeSeries.FieldConfig>
  | TypedPanel<'heatmap', Heatmap.Options, Heatmap.FieldConfig>
  | TypedPanel<'barchart', BarChart.Options, BarChart.FieldConfig>
  | TypedPanel<'stat', Stat.Options, never>
  | TypedPanel<'table', Table.Options, Json<G.TableFieldOptions>>;

export type MoeRow = Omit<Json<G.RowPanel>, 'panels'> & { panels: MoePanel[] };

export type MoeDashboard =
  Omit<Json<G.Dashboard>, 'panels' | 'annotations'> & {
    panels: Array<MoePanel | MoeRow>;
    annotations: { list: Array<Json<G.AnnotationQuery> | PromAnnotation> };
  };
