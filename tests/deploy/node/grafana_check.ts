// Compiled, never run: the dashboard must also be assignable to the published Dashboard type as a
// whole (not only to the stricter MoeDashboard).
import type { Dashboard } from '@grafana/schema';
import type { Json } from './grafana_types';
import { dashboard } from './dashboard.gen';

export const asPublished: Json<Dashboard> = dashboard;
