{{- define "tokenmill.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{- define "tokenmill.secretName" -}}
{{- if .Values.secrets.existingSecret -}}
{{ .Values.secrets.existingSecret }}
{{- else -}}
{{ .Release.Name }}-tokenmill
{{- end -}}
{{- end }}

{{- define "tokenmill.env" -}}
- name: TOKENMILL_NATS_URL
{{- if .Values.nats.enabled }}
  value: nats://{{ .Release.Name }}-nats:4222
{{- else }}
  value: {{ .Values.natsUrl | quote }}
{{- end }}
- name: TOKENMILL_STREAM_REPLICAS
  value: {{ .Values.streamReplicas | quote }}
- name: TOKENMILL_STREAM_PREFIX
  value: {{ .Values.streamPrefix | quote }}
- name: TOKENMILL_ADMIN_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "tokenmill.secretName" . }}, key: admin-token}
{{- if .Values.postgresql.enabled }}
- name: TOKENMILL_PG_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ .Release.Name }}-postgresql, key: password}
- name: TOKENMILL_DATABASE_URL
  value: postgresql://tokenmill:$(TOKENMILL_PG_PASSWORD)@{{ .Release.Name }}-postgresql:5432/tokenmill
{{- else }}
- name: TOKENMILL_DATABASE_URL
  valueFrom:
    secretKeyRef: {name: {{ include "tokenmill.secretName" . }}, key: database-url}
{{- end }}
- name: TOKENMILL_METRICS_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "tokenmill.secretName" . }}, key: metrics-token, optional: true}
{{- end }}
